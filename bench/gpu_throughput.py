"""GPU throughput of our stack vs a plain transformers training step, on one GPU, in one device call.

    PYTHONUNBUFFERED=1 python3 bench/gpu_throughput.py --wheels .whl --out "$OUT"     # H200 (bench/README.md)
    python bench/gpu_throughput.py --cpu-dry-run --out /tmp/bench                      # toy sizes on CPU

Model: Llama-3.1-8B at full width (hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256) with
`--layers` layers, bf16. Ours: `megatron_ext.model.build_model` (local spec + torch SDPA, no TE),
Megatron DDP and distributed optimizer through `megatron_ext.train` (`wrap_ddp`, `build_optimizer`) and
`megatron_ext.train_step` (`forward_step`/`loss_func`) and Megatron's `forward_backward` schedule, as training runs. Peer:
transformers `LlamaForCausalLM` (SDPA attention, bf16 weights, torch AdamW, grad clip 1.0, HF
gradient checkpointing where ours uses full recompute). Each length: warm-up steps, then timed steps
(CUDA events around each whole step: forward, backward, optimizer), median. FLOPs: the causal count
of `megatron_ext.cost_model.train_flops_per_token`. MFU against 989.4 TFLOP/s (bf16 dense datasheet) and
against a bf16 matmul measured in the same run. Out of memory is recorded, not fatal; a time guard
skips what would not finish inside `--budget-s` and records why. JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Long sequences: fewer fragmentation OOMs. Must be set before torch initialises CUDA.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from bench.device_env import BenchError, ensure_packages, environment  # noqa: E402
from bench.measure import Clock, is_oom, measure_matmul, peak_memory_gib, profile_step, timed  # noqa: E402
from bench.report import (  # noqa: E402
    GIB, format_table, median, parse_lengths, predict_step_s, ratios, throughput, write_json_atomic,
)
from bench.gpu_plan import auto_fallback_layers, bench_gpu, partial_layers, planned_memory  # noqa: E402
from bench.stacks import STACKS, Settings, make_recipe  # noqa: E402

SCHEMA = "megatron_ext.bench.gpu_throughput/1"


# ---------------------------------------------------------------------------- settings


def settings_from_args(args: argparse.Namespace) -> Settings:
    dry = args.cpu_dry_run
    try:
        lengths = parse_lengths(args.lengths or ("64,128,256" if dry else "8K,32K,64K,128K"))
        profile = parse_lengths(args.profile_lengths) if args.profile_lengths not in (None, "", "none") else []
    except ValueError as e:
        raise BenchError(f"--lengths/--profile-lengths: {e}") from None
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    bad = [s for s in stacks if s not in ("ours", "peer")]
    if bad or not stacks:
        raise BenchError(f"--stacks {args.stacks!r}: expected a comma list of ours, peer")
    fallback = args.fallback_layers if args.fallback_layers is not None else ("0" if dry else "auto")
    if fallback != "auto" and not fallback.isdigit():
        raise BenchError(f"--fallback-layers {fallback!r}: expected auto or a number of layers (0: off)")
    for flag, value, low in (("--layers", args.layers, 1), ("--warmup", args.warmup, 0), ("--iters", args.iters, 1)):
        if value is not None and value < low:
            raise BenchError(f"{flag} {value}: must be >= {low}")
    from megatron_ext.cost_model import GPU_ALIASES, GPUS
    from megatron_ext.presets import PRESETS

    if args.preset is not None and args.preset not in PRESETS:
        raise BenchError(f"--preset {args.preset!r}: expected one of {sorted(PRESETS)}")
    gpu = GPU_ALIASES.get(args.gpu.lower(), args.gpu.lower()) if args.gpu else ("h200-141gb" if dry or args.device == "cpu" else None)
    if gpu is not None and gpu not in GPUS:
        raise BenchError(f"--gpu {args.gpu!r}: expected one of {', '.join([*GPUS, *GPU_ALIASES])} (default: the "
                         "device's own)")
    out = args.out or os.environ.get("OUT") or str(ROOT / "bench" / "results" / "local")
    return Settings(
        device="cpu" if dry else args.device, preset=args.preset or ("tiny" if dry else "llama3.1-8b"),
        layers=args.layers if args.layers is not None else (None if dry else 4), lengths=lengths,
        recompute_from=args.recompute_from if args.recompute_from is not None else (128 if dry else 65536),
        stacks=stacks, warmup=args.warmup if args.warmup is not None else (1 if dry else 2),
        iters=args.iters if args.iters is not None else (2 if dry else 5), long_step_s=args.long_step_s,
        budget_s=args.budget_s if args.budget_s is not None else (240.0 if dry else 360.0),
        matmul_n=args.matmul_n or (256 if dry else 8192), out=Path(out),
        profile_lengths=profile if args.profile_lengths is not None else ([128] if dry else [32768, 131072]),
        fallback_layers=None if fallback == "auto" else int(fallback), gpu=gpu,
        min_timed_s=args.min_timed_s if args.min_timed_s is not None else (0.0 if dry else 3.0),
        loss_head=args.loss_head, partial_recompute=not args.no_partial_recompute, sdpa_kernel=args.sdpa_kernel,
    )


# ---------------------------------------------------------------------------- the run


class Run:
    """All measurements of one invocation; `self.doc` is the JSON written after every row.

    `flops_per_token(layers, length)`: model FLOPs per token (causal) of the benchmark model with `layers`;
    `gpu`: the `cost_model.GPU` whose memory the planner fits rows in and whose peak MFU is counted against.
    """

    def __init__(self, s: Settings, clock: Clock, doc: dict, flops_per_token, gpu):
        self.s, self.clock, self.doc = s, clock, doc
        self.flops_per_token, self.gpu, self.peak = flops_per_token, gpu, gpu.bf16_tflops
        self.main_layers = self.layers()
        self.results: list[dict] = doc["results"]
        self.json_path = s.out / "gpu_throughput.json"
        (s.out / "profiles.txt").unlink(missing_ok=True)  # profiles are appended to it; start empty

    def layers(self) -> int:
        return self.s.layers if self.s.layers is not None else self.doc["model"]["num_hidden_layers"]

    def save(self) -> None:
        self.doc["elapsed_s"] = self.clock.elapsed()
        main = [r for r in self.results if r.get("layers", self.main_layers) == self.main_layers]
        self.doc["ratios"] = {str(k): v for k, v in ratios(main).items()}
        other = [r for r in self.results if r.get("layers", self.main_layers) != self.main_layers]
        if other:
            self.doc["ratios_fallback_layers"] = {str(k): v for k, v in ratios(other).items()}
        write_json_atomic(self.json_path, self.doc)

    def record(self, row: dict) -> None:
        self.results.append(row)
        self.save()
        tag = f"{row['stack']} L={row['length']} {row['recompute']} {row['layers']} layers"
        if row["status"] == "ok":
            print(f"[bench] {tag}: step {row['step_s']:.3f} s, {row['tokens_per_s']:.0f} tok/s, "
                  f"{row['tflops']:.1f} TFLOP/s, peak {row['peak_gib']:.1f} GiB, "
                  f"loss {row['loss_first']:.3f}->{row['loss_last']:.3f}", flush=True)
        else:
            print(f"[bench] {tag}: {row['status']} ({row['reason']})", flush=True)

    def known(self, stack: str) -> list[tuple[int, str, float]]:
        return [(r["length"], r["recompute"], r["step_s"]) for r in self.results
                if r["stack"] == stack and r["status"] == "ok" and r["layers"] == self.layers()]

    def predicted_step(self, stack: str, length: int, recompute: str) -> float:
        own = self.known(stack)
        other = [(ln, rc, 1.5 * t) for ln, rc, t in self.known("peer" if stack == "ours" else "ours")]
        fallback = 0.25 * (self.doc["matmul"] or {}).get("tflops", 100.0)
        layers = self.layers()
        return predict_step_s(own or other, length, recompute, lambda L: self.flops_per_token(layers, L) * L,
                              fallback)

    def run_stack(self, name: str, recompute: str, lengths: list[int]) -> None:
        import torch

        s, cuda = self.s, self.s.device == "cuda"
        base = {"stack": name, "recompute": recompute, "layers": self.layers()}
        if self.clock.remaining() < 30:
            for L in lengths:
                self.record({**base, "length": L, "status": "skipped", "reason": "time budget (before build)"})
            return
        stack, error = None, None
        try:
            t0 = time.perf_counter()
            stack = STACKS[name](s, recompute)
            self.doc["stacks"].setdefault(name, {})[f"{recompute}/{self.layers()}L"] = {
                **stack.info, "build_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - one broken stack must not cost the other's numbers
            traceback.print_exc()
            error = ("oom" if is_oom(e) else "error", f"build failed: {type(e).__name__}: {str(e)[:300]}")
        if error:
            for L in lengths:
                self.record({**base, "length": L, "status": error[0], "reason": error[1]})
            return
        gen = torch.Generator().manual_seed(1234)
        failed_at = None
        for L in lengths:
            row = {**base, "length": L}
            if name == "ours":
                row["plan"] = planned_memory(s, self.gpu, L, recompute)
            if failed_at is not None:
                self.record({**row, "status": "skipped", "reason": f"out of memory at {failed_at}"})
                continue
            pred = self.predicted_step(name, L, recompute)
            warmup, iters = (1, 3) if pred > s.long_step_s else (s.warmup, s.iters)
            if pred <= s.long_step_s and s.min_timed_s > 0:  # short steps: time at least min_timed_s in all
                iters = max(iters, min(20, math.ceil(s.min_timed_s / max(pred, 1e-6))))
            need = (warmup + iters) * pred * 1.2 + 5
            if need > self.clock.remaining():
                self.record({**row, "status": "skipped", "reason": f"time budget: needs ~{need:.0f} s, "
                             f"{self.clock.remaining():.0f} s left"})
                continue
            row.update(self.measure(stack, L, warmup, iters, gen, cuda))
            if row["status"] == "oom":
                failed_at = L
            self.record(row)  # before the profile: a profiler that fails or runs out of time keeps the row
            if row["status"] == "ok" and L in s.profile_lengths and ":" not in recompute:  # not the extras
                if self.clock.remaining() > 2 * row["step_s"] + 10:
                    try:
                        batch = stack.batch(L, self.doc["model"]["vocab_size"], s.device, gen)
                        row["profile"] = profile_step(stack, batch, s.device, s.out / "profiles.txt",
                                                      f"{name} {L} {self.layers()}L")
                    except Exception as e:  # noqa: BLE001
                        row["profile"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                else:
                    row["profile"] = {"error": "skipped: time budget"}
                self.save()
        del stack
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            self.doc.setdefault("leftover_gib", []).append(
                {"after": f"{name}/{recompute}/{self.layers()}L", "allocated_gib": torch.cuda.memory_allocated() / GIB})

    def run_partial_recompute(self) -> None:
        """Ours again where full recompute ran, recomputing only the first N layers (`train.recompute_layers`)."""
        done = [r["length"] for r in self.results if r["stack"] == "ours" and r["recompute"] == "full"
                and r["status"] == "ok" and r["layers"] == self.main_layers]
        for L in done:
            n = partial_layers(dataclasses.replace(self.s, layers=self.layers()), self.gpu, L)
            if n is not None:
                self.run_stack("ours", f"full:{n}", [L])

    def run_fallback(self, fallback_layers: int | None) -> None:
        """Lengths where our stack ran out of memory (or was skipped after a shorter one did), again with
        `fallback_layers` layers (both stacks); None: per length, the most layers the planner fits."""
        oom = sorted({r["length"] for r in self.results
                      if r["stack"] == "ours" and r["layers"] == self.main_layers
                      and (r["status"] == "oom" or r.get("reason", "").startswith("out of memory at"))})
        main = self.s
        groups: dict[tuple[int, str], list[int]] = {}
        for L in oom:
            recompute = "full" if L >= main.recompute_from else "none"
            n = fallback_layers if fallback_layers is not None else auto_fallback_layers(
                dataclasses.replace(main, layers=self.main_layers), self.gpu, L, recompute)
            if 0 < n < self.main_layers:
                groups.setdefault((n, recompute), []).append(L)
        try:
            for (n, recompute), lengths in sorted(groups.items(), reverse=True):  # most layers first
                self.s = dataclasses.replace(main, layers=n)
                for name in main.stacks:
                    self.run_stack(name, recompute, lengths)
        finally:
            self.s = main

    def measure(self, stack, L: int, warmup: int, iters: int, gen, cuda: bool) -> dict:
        import torch

        s, vocab = self.s, self.doc["model"]["vocab_size"]
        out: dict = {"warmup": warmup, "iters_asked": iters}
        error = None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            batch = stack.batch(L, vocab, s.device, gen)
            losses, times = [], []
            for _ in range(warmup):
                losses.append(stack.step(batch))
            for _ in range(iters):
                t, loss = timed(lambda: stack.step(batch), cuda)
                times.append(t)
                losses.append(loss)
                if self.clock.remaining() < 0:
                    break
            values = [stack.loss_value(x) for x in losses]
            fpt = self.flops_per_token(self.layers(), L)
            out.update(status="ok", step_s=median(times), step_s_all=times, iters=len(times),
                       loss_first=values[0], loss_last=values[-1], flops_per_token=fpt, **peak_memory_gib(s.device))
            out.update(throughput(out["step_s"], L, fpt, self.peak, (self.doc["matmul"] or {}).get("tflops")))
            if not all(math.isfinite(v) for v in values):
                out.update(status="error", reason=f"non-finite loss {values}")
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            oom = is_oom(e)
            if not oom:
                traceback.print_exc()
            error = ("oom" if oom else "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if error:  # outside the except block: the traceback's frames (and their tensors) are gone
            batch = losses = None
            gc.collect()
            out.update(status=error[0], reason=error[1], **(peak_memory_gib(s.device) if cuda else {}))
            if cuda:
                torch.cuda.empty_cache()
        return out


def bench(s: Settings, clock: Clock, installed: list[str], label: str | None = None) -> dict:
    """Measure everything `s` asks for; returns the JSON document (also written to s.out)."""
    import torch

    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.cost_model import shape_from_hf_config, train_flops_per_token
    from megatron_ext.runtime import destroy_distributed, init_distributed, rank_device

    if s.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but no CUDA device is visible; use --cpu-dry-run on a CPU machine")
    hf_cfg = hf_config_from_recipe(make_recipe(s, "none"))
    gpu, gpu_note = bench_gpu(s)

    def flops_per_token(layers: int, L: int) -> float:
        return train_flops_per_token(shape_from_hf_config(dict(hf_cfg, num_hidden_layers=layers)), L, causal=True)

    doc = {"schema": SCHEMA, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "label": label,
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(s).items()},
           "installed_wheels": installed, "model": hf_cfg, "gpu_spec": {"name": gpu.name, "memory_gb": gpu.memory_gb,
                                                                        "note": gpu_note},
           "peak_tflops": gpu.bf16_tflops,
           "flops": "causal, megatron_ext.cost_model.train_flops_per_token (perf.md 5a); recompute not counted",
           "matmul": None, "stacks": {}, "results": []}
    init_distributed(s.device, seed=1234)
    try:
        # NCCL starts lazily: its first collective here, not inside the first timed stack, so that a fault shows in
        # seconds (a hang would cost the whole call)
        torch.distributed.all_reduce(torch.ones(1, device=rank_device()))
        print(f"[bench] {torch.distributed.get_backend()} ok", flush=True)
        doc["environment"] = environment(s.device)
        run = Run(s, clock, doc, flops_per_token, gpu)
        print(f"[bench] planning for {gpu.name} ({gpu.memory_gb:.0f} GB, {gpu.bf16_tflops} TFLOP/s bf16 peak; "
              f"{gpu_note})", flush=True)
        doc["matmul"] = measure_matmul(s.device, s.matmul_n)
        print(f"[bench] bf16 matmul {s.matmul_n}^3: {doc['matmul']['tflops']:.1f} TFLOP/s", flush=True)
        run.save()
        groups = [("none", [L for L in s.lengths if L < s.recompute_from]),
                  ("full", [L for L in s.lengths if L >= s.recompute_from])]
        for recompute, lengths in groups:
            for name in s.stacks:
                if lengths:
                    run.run_stack(name, recompute, lengths)
        if s.fallback_layers != 0:
            run.run_fallback(s.fallback_layers)
        if s.partial_recompute and "ours" in s.stacks:
            run.run_partial_recompute()
        run.save()
        print_summary(doc, s)  # before the teardown, which could hang
    finally:
        destroy_distributed()
    return doc


def print_summary(doc: dict, s: Settings) -> None:
    print()
    print(f"{doc['environment'].get('gpu', s.device)}; model {s.preset} x {doc['model']['num_hidden_layers']} layers, "
          f"bf16; matmul {doc['matmul']['tflops']:.1f} TFLOP/s; peak {doc['peak_tflops']} TFLOP/s; "
          f"{doc['elapsed_s']:.0f} s of {s.budget_s:.0f} s budget", flush=True)
    print(format_table(doc["results"]), flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/gpu_throughput.py", description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on CPU (tiny preset, lengths 64..256)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--preset", default=None, help="architecture preset (default llama3.1-8b; tiny for the dry run)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 4 at full width)")
    p.add_argument("--lengths", default=None, help="comma list, K = 1024 (default 8K,32K,64K,128K)")
    p.add_argument("--recompute-from", type=int, default=None, help="full recompute at this length and above")
    p.add_argument("--stacks", default="ours,peer")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per length (default 2)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per length (default 5)")
    p.add_argument("--long-step-s", type=float, default=4.0,
                   help="predicted steps longer than this get 1 warm-up and 3 timed steps")
    p.add_argument("--min-timed-s", type=float, default=None,
                   help="short steps: more timed steps (up to 20) until about this many seconds are timed (3)")
    p.add_argument("--budget-s", type=float, default=None, help="whole-run time guard in s (default 360)")
    p.add_argument("--matmul-n", type=int, default=None, help="bf16 matmul size for the measured rate (8192)")
    p.add_argument("--profile-lengths", default=None,
                   help="lengths to profile one extra step of (default 32K,128K; 'none' to skip)")
    p.add_argument("--fallback-layers", default=None,
                   help="lengths where ours runs out of memory are run again with this many layers (0: off); default "
                        "auto: per length, the most layers the planner fits in 90%% of the GPU")
    p.add_argument("--gpu", default=None,
                   help="plan memory and count the datasheet MFU for this GPU (h100, h200, b200; default: the "
                        "device's own, by name; h200 in the CPU dry run)")
    p.add_argument("--loss-head", default="chunked", choices=("chunked", "full"),
                   help="our loss head: chunked (megatron_ext.loss_head, default) or Megatron's (full)")
    p.add_argument("--no-partial-recompute", action="store_true",
                   help="skip the extra rows of ours recomputing only the first N layers where full recompute ran "
                        "(N: the fewest the planner fits in 90%% of the GPU)")
    p.add_argument("--sdpa-kernel", default="auto", choices=("auto", "flash", "cudnn", "efficient", "math"),
                   help="ours: the torch SDPA kernel (runtime.sdpa_kernel; default auto, SDPA's own choice)")
    p.add_argument("--label", default=None, help="free text kept in the JSON, e.g. the commit that ran")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local)")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="wheels to install when megatron-core is missing")
    p.add_argument("--site", default=str(ROOT / ".site"),
                   help="where the wheels are installed (pip --target; default .site in the checkout: a fixed folder "
                   "under a shared /tmp could be made first by another user, whose packages would then be imported)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clock = Clock(0.0)
    try:
        s = settings_from_args(args)
        clock.budget_s = s.budget_s
        installed = ensure_packages(Path(args.wheels), Path(args.site))
        bench(s, clock, installed, label=args.label)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bad --preset etc. reaches the recipe checks: one line, not a traceback
        from megatron_ext.recipe import RecipeError

        if not isinstance(e, RecipeError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"JSON: {s.out / 'gpu_throughput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
