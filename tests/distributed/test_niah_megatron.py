"""NIAH and perplexity on the Megatron model across ranks (megatron_ext.evaluate.parallel) against transformers.

A tiny random Llama (llama3 RoPE) with the word-level NIAH tokenizer, converted to a Megatron checkpoint, run at
CP 2, TP 2, PP 2 and DP 2 on gloo. Outside oracle: transformers' `LlamaForCausalLM` on the HF original: the
greedy token after every position of a prompt, the loss of every token, and greedy continuations must be the
same. A draft that agrees with the model must be taken in one forward pass, a wrong one must not change the output.
With the KV cache, the predictions of decode steps (one token, several, rolling back cached ones) must be HF's too,
and a continuation must take one full pass per prompt; a prompt that starts like the cached one runs only its
tokens after the shared prefix (an extension pass), and its predictions must be HF's as well.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/niah_parallel.py"
MAX_NEW = 5
STAMPED = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] \[(niah|ppl|generate)\] ")  # log_lines.stamped's


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cpu_parallel_state):  # the group converts in-process
    from megatron_ext.convert import to_megatron
    from tests.unit.test_evaluate import save_tiny

    d = tmp_path_factory.mktemp("niah_megatron")
    save_tiny(d / "hf")
    to_megatron(d / "hf", d / "mc", progress=False)
    return d


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Prompts (3 rows of 61 tokens: not a multiple of 2 x CP), HF's argmax everywhere, HF greedy, drafts."""
    from megatron_ext.evaluate import greedy_generate, load_hf
    from megatron_ext.evaluate.perplexity import token_losses

    model, _ = load_hf(checkpoints / "hf", "cpu", "fp32")
    prompts = torch.randint(3, 500, (3, 61), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        every = model(input_ids=prompts).logits.argmax(-1).tolist()
    losses = [token_losses(model, row, chunk=None).tolist() for row in prompts]
    greedy = greedy_generate(model, prompts, MAX_NEW, eos_token_ids=(2,), prefill_chunk=None)
    assert all(len(g) == MAX_NEW for g in greedy)  # no EOS: the draft pass counts below assume full length
    drafts = [list(greedy[0]),                                   # the model's own answer: one pass
              [greedy[1][0], (greedy[1][1] + 1) % 500] + greedy[1][2:],  # right, then wrong: 1 + 3 passes
              [(greedy[2][0] + 7) % 500] * MAX_NEW]              # wrong from the start: one pass per token
    # Each starts like the one before (the first like prompt 0): 40, 50 and 13 shared tokens (extensions), then
    # none (a prefill); lengths 61, 66, 61, 61
    row0, row1, row2 = prompts.tolist()
    shared = [row0[:40] + row1[40:], row0[:40] + row1[40:50] + row2[:16], row0[:13] + row2[13:], row1]
    starts = [40, 50, 13, 0]
    for before, ids, start in zip([row0] + shared, shared, starts):
        assert before[:start] == ids[:start] and (start == 0 or before[start] != ids[start])
    with torch.no_grad():
        shared_every = [model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist() for ids in shared]
    shared_greedy = [greedy_generate(model, torch.tensor([ids]), MAX_NEW, eos_token_ids=(2,), prefill_chunk=None)[0]
                     for ids in shared]
    spec = {"prompts": prompts.tolist(), "drafts": drafts, "max_new_tokens": MAX_NEW, "eos": [2],
            "shared": shared, "shared_starts": starts}
    (checkpoints / "inputs.json").write_text(json.dumps(spec))
    return every, greedy, losses, (shared, starts, shared_every, shared_greedy)


@pytest.mark.parametrize("layout", [("--cp", "2"), ("--tp", "2"), ("--pp", "2"), (), ("--cp", "2", "--pp", "2")],
                         ids=["cp2", "tp2", "pp2", "dp2", "cp2pp2"])
def test_megatron_engine_matches_transformers(checkpoints, reference, torchrun, layout):
    every, greedy, losses, (shared, starts, shared_every, shared_greedy) = reference
    out = checkpoints / f"out_{'_'.join(layout) or 'dp2'}.json"
    torchrun(WORKER, 4 if len(layout) > 2 else 2, "--root", str(checkpoints / "mc"),
             "--inputs", str(checkpoints / "inputs.json"),
             "--out", str(out), *layout)
    got = read_json(out)
    for ours, theirs in zip(got["every_position"], every):
        agree = sum(a == b for a, b in zip(ours, theirs))
        assert agree == len(theirs), f"{agree} of {len(theirs)} positions agree"
    assert torch.tensor(got["losses"]).sub(torch.tensor(losses)).abs().max() < 1e-4
    assert 5.0 < torch.tensor(losses).mean() < 7.5  # ~ln(512) for a random model: real numbers compared
    for ours, theirs in zip(got["every_position_cached"], every):
        wrong = [(p, t, theirs[p]) for p, t in ours if t != theirs[p]]
        assert len(ours) == 26 + 8 + 6 + 8 + 11 + 6
        assert not wrong, f"decode steps disagree (position, ours, HF): {wrong}"
    assert got["cached_counts"] == [3, 3 * 10]  # one prefill per prompt, every other step a decode step
    for suffix in ("", "_cached"):
        assert got["no_draft" + suffix] == greedy
        assert got["draft" + suffix] == greedy  # whatever the draft, the output is the greedy one
    # [full passes, decode steps]; draft rows: the model's own answer, right-then-wrong, wrong from the start
    assert got["no_draft_counts"] == [3 * MAX_NEW, 0]
    assert got["draft_counts"] == [1 + (1 + MAX_NEW - 2) + MAX_NEW, 0]
    assert got["no_draft_cached_counts"] == [3, 3 * (MAX_NEW - 1)]
    assert got["draft_cached_counts"] == [3, 0 + (MAX_NEW - 2) + (MAX_NEW - 1)]
    # prompts sharing a prefix with the cached one: an extension pass from its end, then decode steps
    for ours, theirs, ids, start in zip(got["shared_every_position"], shared_every, shared, starts):
        assert [p for p, _ in ours] == list(range(start, len(ids)))
        wrong = [(p, t, theirs[p]) for p, t in ours if t != theirs[p]]
        assert not wrong, f"after {start} shared tokens (position, ours, HF): {wrong}"
    assert got["shared_counts"] == [1 + 1, 3, 40 + 50 + 13, 2 * len(shared)]  # [passes, extensions, shared, decode]
    assert got["shared_greedy"] == shared_greedy
    # [passes, extensions] of their greedy continuations, from an empty cache; one replica: as above but for the
    # first; two (dp2): prompts 0 and 2 on one (13 shared), 1 and 3 on the other (nothing shared)
    assert got["shared_greedy_counts"] == ([3, 1] if layout == () else [2, 2])


def test_cli_megatron_engine_equals_hf_engine(checkpoints, torchrun, tmp_path):
    """tools/niah.py --engine megatron --cp 2 scores and writes what the transformers path does."""
    from megatron_ext.evaluate.cli import main

    common = ["--lengths", "96,200", "--depths", "0,100", "--max-new-tokens", "6", "--no-progress"]
    main(["--model", str(checkpoints / "hf"), "--out", str(tmp_path / "hf"), *common])
    torchrun(ROOT / "tools/niah.py", 2, "--megatron", str(checkpoints / "mc"), "--engine", "megatron", "--cp", "2",
             "--tokenizer", str(checkpoints / "hf"), "--out", str(tmp_path / "mg"), *common)
    hf, mg = read_json(tmp_path / "hf/results.json"), read_json(tmp_path / "mg/results.json")
    assert mg["scores"] == hf["scores"] and mg["lengths"] == [96, 200]
    for a, b in zip(hf["cells"], mg["cells"]):
        assert (a["length"], a["depth"], a["value"]) == (b["length"], b["depth"], b["value"])
        assert b["output"] and a["output"].startswith(b["output"])  # ours stops once the first number is settled
    assert mg["settings"]["engine"] == "megatron" and mg["settings"]["layout"]["context"] == 2
    assert (tmp_path / "mg/heatmap.png").is_file()
    # --resume with one more depth: the 4 scored cells are kept, the 2 new ones run (with the cache: a prefill, then
    # a pass after the haystack both share, the 96-token prompt's up to its needle)
    out = torchrun(ROOT / "tools/niah.py", 2, "--megatron", str(checkpoints / "mc"), "--engine", "megatron",
                   "--cp", "2", "--tokenizer", str(checkpoints / "hf"), "--out", str(tmp_path / "mg"), "--resume",
                   *common[:2], "--depths", "0,50,100", *common[4:])
    resumed = read_json(tmp_path / "mg/results.json")
    assert "4 of 6 cells kept" in out
    # Rank 0 alone prints the progress lines, each after the local time as the trainer's: the layout, the kept
    # cells, a line per length and the accuracy; once each, not once per rank
    tagged = [line for line in out.splitlines() if "[niah] " in line]
    assert all(STAMPED.match(line) for line in tagged), out
    said = [line.split("] [niah] ", 1)[1] for line in tagged]
    assert [sum(s.startswith(w) for s in said) for w in ("Megatron engine", "4 of 6 cells kept", "length ",
                                                          "accuracy ")] == [1, 1, 2, 1], said
    assert (resumed["settings"]["forward_passes"], resumed["settings"]["extension_passes"]) == (1, 1)
    assert [c for c in resumed["cells"] if c["depth"] != 50] == mg["cells"]


@pytest.mark.parametrize("layout", [("--cp", "2"), ()], ids=["cp2", "dp2"])
def test_cli_ppl_megatron_engine_equals_hf_engine(checkpoints, torchrun, tmp_path, layout):
    """Loss by position over three documents of different lengths; with DP 2 the replicas share them."""
    from megatron_ext.evaluate.cli import main

    docs = []
    for i, repeat in enumerate((30, 12, 21)):
        docs.append(tmp_path / f"doc{i}.txt")
        docs[-1].write_text(" ".join(["the special magic number is hidden in the text below"] * repeat))
    common = ["--text", *map(str, docs), "--no-progress"]
    main(["ppl", "--model", str(checkpoints / "hf"), "--out", str(tmp_path / "hf"), *common])
    out = torchrun(ROOT / "tools/niah.py", 2, "ppl", "--megatron", str(checkpoints / "mc"), "--engine", "megatron",
                   *layout, "--tokenizer", str(checkpoints / "hf"), "--out", str(tmp_path / "mg"), *common)
    tagged = [line for line in out.splitlines() if "[ppl] " in line]  # rank 0's layout and summary, stamped
    assert len(tagged) == 2 and all(STAMPED.match(line) for line in tagged), out
    assert "] [ppl] Megatron engine: " in tagged[0] and "] [ppl] 3 documents, " in tagged[1], out
    hf, mg = read_json(tmp_path / "hf/ppl.json"), read_json(tmp_path / "mg/ppl.json")
    assert hf["doc_tokens"] == mg["doc_tokens"] and hf["doc_tokens"][0] > 200 and len(hf["doc_tokens"]) == 3
    for a, b in zip(hf["buckets"], mg["buckets"]):
        assert (a["start"], a["end"], a["tokens"]) == (b["start"], b["end"], b["tokens"])
        assert abs(a["mean_loss"] - b["mean_loss"]) < 1e-4
    assert mg["settings"]["engine"] == "megatron" and (tmp_path / "mg/ppl.png").is_file()
    assert mg["settings"]["layout"]["data"] == (2 if not layout else 1)
    # DP 2: replica 0 ran documents 0 and 2, replica 1 document 1 (control: each replica running all gives [3, 3])
    assert mg["settings"]["documents_per_replica"] == ([2, 1] if not layout else [3])


def test_cli_generate_megatron_engine_equals_hf_engine(checkpoints, torchrun, tmp_path):
    """niah.py generate: a document and a question, greedy on transformers and on the Megatron engine at CP 2 (one
    pass over the prompt, then a decode step per token through the KV cache): the same tokens."""
    from megatron_ext.evaluate.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(["the special magic number is hidden in the text below"] * 12))
    common = ["--document", str(doc), "--question", "what is the special magic number", "--max-new-tokens", "12"]
    main(["generate", "--model", str(checkpoints / "hf"), "--out", str(tmp_path / "hf"), *common])
    stdout = torchrun(ROOT / "tools/niah.py", 2, "generate", "--megatron", str(checkpoints / "mc"), "--engine",
                      "megatron", "--cp", "2", "--tokenizer", str(checkpoints / "hf"), "--out", str(tmp_path / "mg"),
                      *common)
    hf, mg = read_json(tmp_path / "hf/generation.json"), read_json(tmp_path / "mg/generation.json")
    assert mg["prompt_tokens"] == hf["prompt_tokens"] > 100
    assert mg["output_ids"] == hf["output_ids"] and hf["output_ids"]
    assert mg["output"] == hf["output"] and mg["output"] in stdout
    announced = [line for line in stdout.splitlines() if "[generate] " in line]
    assert len(announced) == 1 and STAMPED.match(announced[0]) and " per rank" in announced[0], stdout
    n = len(mg["output_ids"])
    assert (mg["settings"]["forward_passes"], mg["settings"]["decode_steps"]) == (1, n - 1)


@pytest.mark.parametrize("layout", [("--cp", "2"), ()], ids=["cp2", "dp2"])
def test_cli_ruler_megatron_engine_equals_hf_engine(checkpoints, torchrun, tmp_path, layout):
    """niah.py ruler: the same prompts and greedy outputs on transformers and on the Megatron engine (CP 2, or DP 2
    replicas sharing prompts of different lengths in one call); with the KV cache one full pass per prompt."""
    from megatron_ext.evaluate.cli import main

    common = ["--tasks", "niah_single_1,niah_multikey_2,vt,fwe", "--lengths", "224,248", "--samples", "2",
              "--max-new-tokens", "4", "--no-progress"]
    main(["ruler", "--model", str(checkpoints / "hf"), "--out", str(tmp_path / "hf"), *common])
    out = torchrun(ROOT / "tools/niah.py", 2, "ruler", "--megatron", str(checkpoints / "mc"), "--engine", "megatron",
                   *layout, "--tokenizer", str(checkpoints / "hf"), "--out", str(tmp_path / "mg"), *common)
    hf, mg = read_json(tmp_path / "hf/ruler.json"), read_json(tmp_path / "mg/ruler.json")
    key = lambda c: (c["task"], c["length"], c["sample"], c["answers"], c["prompt_tokens"], c["output"])  # noqa: E731
    assert [key(c) for c in mg["cells"]] == [key(c) for c in hf["cells"]] and len(hf["cells"]) == 16
    assert len({c["prompt_tokens"] for c in hf["cells"]}) > 2  # needle-haystack and fwe prompts: other lengths
    assert mg["scores"] == hf["scores"] and "| **average** |" in out

    def table(run: str) -> list[str]:  # ruler.md without its title (which names the model)
        return [line for line in (tmp_path / run / "ruler.md").read_text().splitlines() if line.startswith("|")]

    assert table("mg") == table("hf") and len(table("hf")) == 7
    # with the KV cache at most one pass per prompt: a full one, or one after the prefix it shares with the one
    # before (the samples of a task share their haystack), or none where only the last 64 tokens or fewer differ
    # (a decode step)
    settings = mg["settings"]
    assert settings["extension_passes"] > 0 and settings["forward_passes"] + settings["extension_passes"] <= 16


@pytest.mark.parametrize("argv, message", [
    (["--model", "HF", "--engine", "megatron"], "give --megatron CKPT_DIR"),
    (["--megatron", "CKPT", "--cp", "2"], "belong to --engine megatron"),
    (["--model", "HF", "--no-kv-cache"], "--no-kv-cache belong to --engine megatron"),
    (["generate", "--model", "HF"], "nothing to ask: give --document FILE"),
    (["generate", "--model", "HF", "--document", "CKPT/none.txt"], "none.txt does not exist: give a UTF-8 text file"),
    (["generate", "--model", "HF", "--question", "why", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--megatron", "CKPT", "--engine", "megatron", "--cp", "2"], "must divide the 1 processes"),
    (["--megatron", "CKPT/missing", "--engine", "megatron"], "missing does not exist"),
    # Megatron-Core's bare AssertionError (num_layers divisible by pipeline size) after the group started, before:
    (["--megatron", "CKPT", "--engine", "megatron", "--pp", "3"], "--pp 3: the model in {mc} has 2 layers, which do "
     "not split evenly over 3 pipeline stages; give a --pp that divides 2 (1, 2), or use --tp/--cp"),
    # Megatron-Core's ValueError on every rank; 4 fits though above the 2 KV heads (each on 2 ranks)
    (["--megatron", "CKPT", "--engine", "megatron", "--tp", "3"], "--tp 3: the model in {mc} (4 attention heads, 2 "
     "KV heads, MLP width 176) does not split evenly over 3 tensor-parallel ranks; give --tp 1, 2 or 4, or use --cp"),
])
def test_cli_user_errors(checkpoints, tmp_path, capsys, argv, message):
    from megatron_ext.evaluate.cli import main

    argv = [a.replace("HF", str(checkpoints / "hf")).replace("CKPT", str(checkpoints / "mc")) for a in argv]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "o"), "--no-progress"] + ([] if argv[0] in ("ppl", "generate")
                                                                         else ["--lengths", "96"]))
    assert message.replace("{mc}", str(checkpoints / "mc")) in str(e.value) and str(e.value).startswith("error: ")


def test_engine_bench_runs_at_toy_size(checkpoints, torchrun, tmp_path):
    """bench/niah_engine_bench.py stays runnable (a random model: the draft is refused, the outputs are the same; the
    KV cache leaves one full pass per prompt; with the shared prefix, prompts after the first run only their tokens
    after the haystack they share with the one before)."""
    out = torchrun(ROOT / "bench/niah_engine_bench.py", 2, "--megatron", str(checkpoints / "mc"), "--cp", "2",
                   "--tokenizer", str(checkpoints / "hf"), "--lengths", "256", "--depths", "0,50,100",
                   "--max-new-tokens", "3", "--out", str(tmp_path))
    (path,) = tmp_path.glob("niah_engine-*.json")
    rows = read_json(path)["rows"]
    assert [r["mode"] for r in rows] == ["token_by_token", "draft", "kv_cache", "draft+kv_cache",
                                         "+shared_prefix"] and "wrote" in out
    assert rows[0]["forward_passes"] == 3 * 3 and 3 <= rows[1]["forward_passes"] <= 3 * 3
    assert (rows[2]["forward_passes"], rows[2]["decode_steps"]) == (3, 3 * 2)
    assert rows[3]["forward_passes"] == 3 and rows[3]["decode_steps"] <= 3 * 2
    assert all(r["extension_passes"] == 0 for r in rows[:4])
    # depth 0 shares only the instruction with depth 50 (a prefill), depth 50 its haystack's first half with 100
    assert (rows[4]["forward_passes"], rows[4]["extension_passes"]) == (2, 1)
    assert 0.4 * 256 < rows[4]["shared_tokens"] < 0.6 * 256 and rows[4]["decode_steps"] == rows[3]["decode_steps"]


def test_kv_cache_bench_runs_at_toy_size(checkpoints, torchrun, tmp_path):
    """bench/kv_cache_bench.py stays runnable; its decode steps predict what full passes over the same tokens do."""
    out = torchrun(ROOT / "bench/kv_cache_bench.py", 2, "--megatron", str(checkpoints / "mc"), "--cp", "2",
                   "--lengths", "64,128", "--steps", "3", "--out", str(tmp_path))
    (path,) = tmp_path.glob("kv_cache-*.json")
    rows = read_json(path)["rows"]
    assert [r["length"] for r in rows] == [64, 128] and all(r["same_predictions"] for r in rows) and "wrote" in out
    assert all(r["full_pass_s"] > 0 and r["decode_step_s"] > 0 for r in rows)


def test_out_of_memory_on_one_rank_ends_the_run(checkpoints):
    """run_niah retries a batch that ran out of memory in halves; across ranks that would leave the others inside
    a collective, so the engine turns it into an error naming the rank and the fix."""
    from megatron_ext.evaluate import run_niah
    from megatron_ext.evaluate.errors import RankError
    from megatron_ext.evaluate.parallel import MegatronGreedy
    from tests.unit.test_evaluate import make_tokenizer

    def oom(ids, first, known_same=0):
        raise torch.OutOfMemoryError("CUDA out of memory")

    gen = MegatronGreedy(model=None, vocab_size=512, max_new_tokens=4, kv_cache=False)
    gen.predict = oom
    tok = make_tokenizer()
    with pytest.raises(RankError, match=r"rank 0: out of memory on a 96-token prompt .* raise --cp"):
        run_niah(None, tok, [96], [50], generate=gen, progress=False, log=None)
    # control: one device's generate that runs out of memory is retried, then recorded as not run
    with pytest.warns(UserWarning, match="out of memory even as a batch of 1"):
        result = run_niah(None, tok, [96], [50], generate=lambda ids: oom(None, 0), progress=False, log=None)
    assert result.cells[0]["error"] == "out of memory"
