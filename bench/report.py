"""Pure helpers of the GPU throughput benchmark: metrics, step-time prediction, table, kernel buckets.

No torch, no Megatron: everything here is arithmetic over numbers the benchmark measured, so it is
tested exactly (tests/unit/test_bench_report.py). FLOPs come from `megatron_ext.cost_model` (perf.md
section 5a, causal count); this module only divides.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable, Iterable

GIB = 2**30


def median(values: Iterable[float]) -> float:
    """Median of a non-empty sequence (the statistic METHOD.md asks for)."""
    values = list(values)
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def throughput(step_s: float, tokens_per_step: int, flops_per_token: float, peak_tflops: float,
               matmul_tflops: float | None) -> dict:
    """tokens/s, model TFLOP/s per GPU and MFU (vs the datasheet peak and vs the measured matmul rate).

    One GPU: TFLOP/s per GPU is the whole step's model FLOPs over its time. Recompute is not counted
    (model FLOPs, not hardware FLOPs), so recompute shows as lower MFU, as in perf.md.
    """
    if step_s <= 0:
        raise ValueError(f"step time {step_s} s: must be > 0")
    tokens_per_s = tokens_per_step / step_s
    tflops = flops_per_token * tokens_per_s / 1e12
    return {
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu_peak": tflops / peak_tflops,
        "mfu_matmul": tflops / matmul_tflops if matmul_tflops else None,
    }


def predict_step_s(known: list[tuple[int, str, float]], length: int, recompute: str,
                   step_flops: Callable[[int], float], fallback_tflops: float) -> float:
    """Expected seconds of one step at `length`, for the time guard.

    `known`: (length, recompute, median step s) measured so far for this stack (or the other one).
    Scales the nearest measurement by the model FLOPs of a step; full recompute adds a forward
    (x 4/3) when the measurement had none. Without any measurement: FLOPs / `fallback_tflops`.
    """
    if not known:
        return step_flops(length) / (fallback_tflops * 1e12)
    # full:N (the first N layers recomputed) is predicted as full: an upper bound for the time guard
    known = [(ln, rc.partition(":")[0], t) for ln, rc, t in known]
    recompute = recompute.partition(":")[0]
    near_len, near_rec, near_s = min(known, key=lambda k: (abs(k[0] - length), k[1] != recompute))
    scale = step_flops(length) / step_flops(near_len)
    if recompute == "full" and near_rec != "full":
        scale *= 4.0 / 3.0
    elif near_rec == "full" and recompute != "full":
        scale *= 3.0 / 4.0
    return near_s * scale


def ratios(results: list[dict], ours: str = "ours", peer: str = "peer") -> dict[int, float | None]:
    """ours / peer tokens/s at each length where both ran ('ok'); None where one of them did not.
    Rows with partial recompute (`full:N`, an extra of ours) are not the comparison."""
    by = {(r["stack"], r["length"]): r for r in results if ":" not in r.get("recompute", "")}
    out: dict[int, float | None] = {}
    for length in sorted({r["length"] for r in results}):
        a, b = by.get((ours, length)), by.get((peer, length))
        ok = a and b and a["status"] == "ok" and b["status"] == "ok"
        out[length] = a["tokens_per_s"] / b["tokens_per_s"] if ok else None
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%" if x >= 1e-3 else f"{100 * x:.2g}%"


def _num(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def format_table(results: list[dict]) -> str:
    """The one table: a row per (layers, length, stack); ours/peer (same layers and length) on the ours row."""
    ratio = {}
    for layers in {r.get("layers") for r in results}:
        group = [r for r in results if r.get("layers") == layers]
        ratio.update({(layers, length): v for length, v in ratios(group).items()})
    head = (f"{'length':>8} {'layers':>6} {'stack':<5} {'recomp':<6} {'step_s':>8} {'tokens/s':>10} {'TFLOP/s':>8} "
            f"{'MFU@peak':>8} {'MFU@mm':>7} {'peak_GiB':>8} {'ours/peer':>9}  status")
    lines = [head, "-" * len(head)]
    peer_ok = {(r.get("layers"), r["length"]): r for r in results if r["stack"] == "peer" and r["status"] == "ok"}
    for r in sorted(results, key=lambda r: (-(r.get("layers") or 0), r["length"], r["stack"] != "ours")):
        rat = ratio.get((r.get("layers"), r["length"])) if r["stack"] == "ours" else None
        if r["stack"] == "ours" and ":" in r["recompute"]:  # a partial-recompute extra: its own ratio
            peer = peer_ok.get((r.get("layers"), r["length"]))
            rat = r["tokens_per_s"] / peer["tokens_per_s"] if peer and r["status"] == "ok" else None
        rat_s = f"{rat:.2f}x" if rat is not None else "-"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"[:60]
        lead = f"{r['length']:>8} {r.get('layers', '-'):>6} {r['stack']:<5} {r['recompute']:<6}"
        if r["status"] == "ok":
            mem = r.get("peak_gib")
            lines.append(
                f"{lead} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} "
                f"{_num(r['tflops']):>8} {_pct(r['mfu_peak']):>8} {_pct(r['mfu_matmul']):>7} "
                f"{'-' if mem is None else f'{mem:.1f}':>8} {rat_s:>9}  {status}")
        else:
            lines.append(f"{lead} {'-':>8} {'-':>10} {'-':>8} {'-':>8} {'-':>7} {'-':>8} {rat_s:>9}  {status}")
    return "\n".join(lines)


# Kernel-name buckets of a device profile, first match wins (attention before gemm: fmha kernels
# are CUTLASS kernels too). Names as CUDA/cuBLAS/PyTorch print them.
KERNEL_BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("multi_tensor", "adam")),
    ("softmax/loss", ("softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("copy/cast", ("memcpy", "memset", "copy", "cast")),
    ("communication", ("nccl", "c10d::", "allreduce", "all_gather", "reduce_scatter")),
    ("elementwise/reduce", ("elementwise", "reduce", "vectorized", "unrolled", "index")),
)


def bucket_kernels(kernels: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Sum device time per bucket of kernel names (`KERNEL_BUCKETS`, else 'other'); same unit as input."""
    out = {name: 0.0 for name, _ in KERNEL_BUCKETS}
    out["other"] = 0.0
    for name, t in kernels:
        low = name.lower()
        for bucket, keys in KERNEL_BUCKETS:
            if any(k in low for k in keys):
                out[bucket] += t
                break
        else:
            out["other"] += t
    return out


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary name and rename it into place (a killed run leaves the last good file)."""
    from megatron_ext.evaluate.io import write_atomic

    write_atomic(path, lambda f: f.write(json.dumps(data, indent=1, sort_keys=False) + "\n"))


def parse_lengths(text: str) -> list[int]:
    """'8192,32k,128K' -> [8192, 32768, 131072] (K = 1024); raises ValueError with the bad item."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        mult = 1024 if item[-1] in "kK" else 1
        try:
            value = int(item[:-1] if mult != 1 else item) * mult
        except ValueError:
            raise ValueError(f"{item!r} is not a length (e.g. 8192 or 32K)") from None
        if value < 2:
            raise ValueError(f"{item!r}: a length must be >= 2")
        out.append(value)
    if not out:
        raise ValueError("no lengths given")
    return sorted(set(out))
