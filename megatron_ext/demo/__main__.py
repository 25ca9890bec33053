"""`make demo` / `python -m megatron_ext.demo [--fresh] [--quick] [--out DIR]`: the UltraLong pipeline at toy scale.

Steps (each printed with its time; all but the base run the project's real CLIs as subprocesses):
  0. tokenizer      the demo BPE (digits one per token, Llama-3 special tokens and chat template)
  a. base           tiny Llama-3.1-shaped model trained at 256 tokens -> HF folder (cached)
  b. to-megatron    tools/convert.py to-megatron
  c. data           synthetic corpus -> tools/prepare_data.py cpt (`<s>` separators) and sft
  d. cpt            torchrun x2 -m megatron_ext.train: YaRN factor 8 at 2048 tokens, CP=2
  e. sft            torchrun x2 -m megatron_ext.train: SFT on chat-formatted needle questions up to 2048 tokens
  e'. sft ablation  the same SFT from the base with the base's RoPE (no YaRN, no CPT)
  f. to-hf          tools/convert.py to-hf (CPT, SFT and ablation checkpoints)
  g. evaluate       tools/niah.py on base, base+YaRN (untrained), CPT, SFT (--chat); tools/niah.py ppl on base, CPT
                    and final;
                    the final grid again on the Megatron checkpoint itself (--engine megatron, CP 2 under torchrun)
Writes demo_out/REPORT.md with the accuracy table, heatmaps and the perplexity plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

# The demo runs on the CPU, also on a machine with GPUs: its Megatron-Core steps use the CPU backend, which needs the
# GPUs hidden before torch is imported (megatron_ext/runtime/cpu_backend.py); the subprocesses inherit this.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

from megatron_ext.runtime.gpu_packages import hide_gpu_packages  # noqa: E402

hide_gpu_packages()  # and Transformer Engine / Apex, before Megatron-Core is imported (cpu_backend.py, P0)

from megatron_ext.demo.pipeline import (ABLATION, ROOT, DemoSettings, StepLog,  # noqa: E402
                                        rope_overrides_from_hf, run_tool, run_tools, torchrun,
                                        yarn_untrained)


def run_demo(out: Path, settings: DemoSettings, fresh: bool = False) -> Path:
    """Run the whole pipeline into `out`; return the report's path."""
    from megatron_ext.demo.corpus import build_demo_tokenizer, demo_chats, demo_corpus
    from megatron_ext.demo.report import write_report
    from megatron_ext.data.toy import write_jsonl

    t_start = time.time()
    py = sys.executable
    s = settings
    # The tools run with the checkout as their working directory (pipeline.run_tool), where a relative `out` from a
    # caller elsewhere would name another folder.
    out = Path(out).absolute()
    if fresh and out.exists():
        print(f"[demo] FRESH: removing {out}")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    steps = StepLog()
    tok_dir, base_hf = out / "tokenizer", out / "base_hf"

    # 0 + a: the "released" model, cached (it is the expensive, unchanging part).
    stamp = base_hf / "demo_base.json"
    try:  # a stamp cut short by a killed run is no stamp (it is written last, after the base model)
        cached = json.loads(stamp.read_text()) == s.base_key() and (tok_dir / "tokenizer.json").is_file()
    except (OSError, ValueError):
        cached = False
    if cached:
        print(f"[demo] reusing the cached base model {base_hf} (make demo FRESH=1 retrains it)")
        steps.cached.add("base")
        steps.seconds["base (cached)"] = 0.0
    else:
        from megatron_ext.demo.base import train_base

        steps.run("tokenizer", build_demo_tokenizer, tok_dir, seed=s.seed)
        steps.run("base", train_base, base_hf, tok_dir, steps=s.base_steps, batch_size=s.base_batch, lr=s.base_lr,
                  seed=s.seed, recall_weight=s.base_recall_weight, kv_every=s.base_kv_every,
                  length_power=s.base_length_power)
        stamp.write_text(json.dumps(s.base_key()))

    # b: HF -> Megatron.
    base_mg = out / "base_megatron"
    steps.run("to-megatron", run_tool, [py, "tools/convert.py", "to-megatron", "--hf", base_hf, "--out", base_mg,
                                        "--force", "--no-progress"])

    # c: data. CPT documents of 100-200 filler sentences (about 1100-2100 tokens, so a 2048-token
    # sequence holds mostly one needle, at any distance from its question); SFT chats of 20-150
    # sentences (about 300-2000 tokens), so the answer is learnt at every distance up to 2048.
    data = out / "data"
    data.mkdir(exist_ok=True)

    def make_data() -> None:
        write_jsonl(data / "cpt.jsonl", demo_corpus(s.cpt_docs, s.seed + 100, 100, 200))
        write_jsonl(data / "sft.jsonl", demo_chats(s.sft_chats, s.seed + 200, 20, 150))
        run_tools([[py, "tools/prepare_data.py", "cpt", "--input", data / "cpt.jsonl", "--tokenizer", tok_dir,
                    "--output", data / "cpt", "--separator", "<s>", "--seq-length", "2048", "--force", "--quiet"],
                   [py, "tools/prepare_data.py", "sft", "--input", data / "sft.jsonl", "--tokenizer", tok_dir,
                    "--output", data / "sft", "--seq-length", "2048", "--force", "--quiet"]])
        # Held-out long documents for perplexity by position.
        ppl_dir = data / "ppl"
        ppl_dir.mkdir(exist_ok=True)
        for i, d in enumerate(demo_corpus(s.ppl_docs, s.seed + 300, 200, 200)):
            (ppl_dir / f"doc{i}.txt").write_text(d["text"])

    steps.run("data", make_data)

    # d: YaRN CPT at 8x, CP=2 on two gloo processes.
    cpt_dir, sft_dir = out / "cpt", out / "sft"
    for d in (cpt_dir, sft_dir):
        shutil.rmtree(d, ignore_errors=True)
    steps.run("cpt", run_tool, torchrun(2) + [
        "-m", "megatron_ext.train", "--recipe", "recipes/demo/cpt.yaml", "model.preset=null", f"model.hf_config={base_hf}",
        f"model.tokenizer={tok_dir}", f"data.prefix={data / 'cpt'}", f"checkpoint.init_from={base_mg}",
        f"checkpoint.dir={cpt_dir}", f"train.steps={s.cpt_steps}", f"train.global_batch_size={s.cpt_batch}",
        f"train.warmup_steps={max(0, min(4, s.cpt_steps - 1))}"], log_file=out / "cpt.log")

    # e: SFT (chat-formatted needle questions, loss on the answer only), data parallel over two processes.
    def sft_command(init_from: Path, ckpt_dir: Path, *overrides: str) -> list:
        return torchrun(2) + [
            "-m", "megatron_ext.train", "--recipe", "recipes/demo/sft.yaml", "model.preset=null", f"model.hf_config={base_hf}",
            f"model.tokenizer={tok_dir}", f"data.prefix={data / 'sft'}", f"checkpoint.init_from={init_from}",
            f"checkpoint.dir={ckpt_dir}", f"train.steps={s.sft_steps}",
            f"train.warmup_steps={max(0, min(4, s.sft_steps - 1))}", *overrides]

    sft_ok = True
    try:
        steps.run("sft", run_tool, sft_command(cpt_dir, sft_dir), log_file=out / "sft.log")
    except RuntimeError as e:
        sft_ok = False
        print(f"[demo] SFT step failed; the report shows the CPT model as final.\n{e}", file=sys.stderr)

    # Ablation: the same SFT from the base, with the base's own RoPE (no YaRN, no CPT), to show what
    # the YaRN extension adds.
    ablation_dir = out / "sft_no_yarn"
    shutil.rmtree(ablation_dir, ignore_errors=True)
    steps.run("sft ablation", run_tool, sft_command(base_mg, ablation_dir, *rope_overrides_from_hf(base_hf)),
              log_file=out / "sft_no_yarn.log")

    # f: Megatron -> HF.
    cpt_hf, sft_hf, ablation_hf = out / "cpt_hf", out / "sft_hf", out / "sft_no_yarn_hf"

    def export() -> None:
        pairs = [(cpt_dir, cpt_hf)] + ([(sft_dir, sft_hf)] if sft_ok else []) + [(ablation_dir, ablation_hf)]
        run_tools([[py, "tools/convert.py", "to-hf", "--megatron", src, "--out", dst, "--max-position-embeddings",
                    "2048", "--tokenizer", tok_dir, "--force", "--no-progress"] for src, dst in pairs])

    steps.run("to-hf", export)

    # g: evaluation with the real CLI.
    yarn_hf = yarn_untrained(base_hf, out / "base_yarn_hf", ROOT / "recipes/demo/cpt.yaml")
    models = {"base": base_hf, "base + YaRN, no training": yarn_hf, "after YaRN CPT": cpt_hf}
    if sft_ok:
        models["after CPT + SFT"] = sft_hf
    models[ABLATION] = ablation_hf
    evals = out / "eval"
    lengths = ",".join(str(n) for n in s.lengths)

    def evaluate() -> None:
        # the HF grids and loss curves are independent one-thread processes: two at a time
        hf_runs = []
        for i, (label, path) in enumerate(models.items()):
            chat = ["--chat"] if label in ("after CPT + SFT", ABLATION) else []  # SFT models: their chat format
            hf_runs.append([py, "tools/niah.py", "--model", path, "--out", evals / f"niah{i}", "--lengths", lengths,
                            "--depths", s.depths, "--samples", str(s.samples), "--force", "--device", "cpu",
                            "--title", f"NIAH: {label}", "--no-progress", *chat])
        # Loss by position: the CPT is what extends the language model; the SFT then narrows it to answers.
        curves = [("base", "base"), ("cpt", "after YaRN CPT")] + ([("final", "after CPT + SFT")] if sft_ok else [])
        for tag, label in curves:
            hf_runs.append([py, "tools/niah.py", "ppl", "--model", models[label], "--out", evals / f"ppl_{tag}",
                            "--text", *sorted((data / "ppl").glob("*.txt")), "--seq-len", str(max(s.lengths)),
                            "--label", label, "--device", "cpu", "--no-progress"])
        run_tools(hf_runs)
        if sft_ok:  # the same grid on the final Megatron checkpoint itself: no conversion, CP 2 (how 1M+ is evaluated)
            run_tool(torchrun(2) + ["tools/niah.py", "--megatron", sft_dir, "--engine", "megatron", "--cp", "2",
                                    "--tokenizer", tok_dir, "--out", evals / "megatron_niah", "--lengths", lengths,
                                    "--depths", s.depths, "--samples", str(s.samples), "--force", "--device", "cpu",
                                    "--chat", "--title", "NIAH: after CPT + SFT, Megatron engine (CP 2)",
                                    "--no-progress"])

    steps.run("evaluate", evaluate)
    report = write_report(out, models, steps, settings, total_s=time.time() - t_start)
    print(f"\n[demo] done in {time.time() - t_start:.0f}s: {report}")
    print((out / "REPORT.md").read_text().split("## Time per step")[0])
    return report


def _absolute_path(text: str) -> Path:
    """A path argument made absolute from the directory the demo was started in: the pipeline runs its tools with
    the checkout as their working directory, where a relative path would name another folder."""
    return Path(text).expanduser().absolute()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's command line; every path in it absolute."""
    ap = argparse.ArgumentParser(prog="python -m megatron_ext.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=_absolute_path, default=ROOT / "demo_out", metavar="DIR",
                    help="folder for the models, data, evaluations and REPORT.md; a relative path is taken from "
                         "the current directory (default: demo_out in the checkout, %(default)s)")
    ap.add_argument("--fresh", action="store_true", default=os.environ.get("FRESH", "") not in ("", "0"),
                    help="redo everything, the cached base model included (also: FRESH=1)")
    ap.add_argument("--quick", action="store_true", help="reduced sizes (the test's version)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = DemoSettings.quick() if args.quick else DemoSettings()
    try:
        run_demo(args.out, settings, fresh=args.fresh)
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
