"""Timing, memory and profiling primitives of the benchmarks (METHOD.md: warm-up, events, medians)."""

from __future__ import annotations

import time
from pathlib import Path

from bench.report import GIB, bucket_kernels, median


class Clock:
    """Seconds since the script started, against the whole run's budget."""

    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()


def cpu_peak_allocated_bytes(fn) -> int:
    """Highest CPU allocation level above the starting level while `fn` runs (torch profiler allocator events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    level = peak = 0
    for _, size in sorted(events):
        level += size
        peak = max(peak, level)
    return peak


def step_time_and_peak(step, iters: int, device: str) -> dict:
    """`step()` once to warm up, `iters` timed calls (median seconds; the device is synchronized around
    each), then one more call for its peak bytes allocated above its start (CUDA: `max_memory_allocated`;
    CPU: the profiler's allocator events). Returns `step_s`, `step_s_all`, `peak_bytes` and `out`, the
    output of the last timed call."""
    import statistics

    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    step()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - start
    else:
        peak = cpu_peak_allocated_bytes(step)
    return {"step_s": statistics.median(times), "step_s_all": times, "peak_bytes": peak, "out": out}


def timed(fn, cuda: bool) -> tuple[float, object]:
    """Seconds of `fn()` on the device: CUDA events around it and a wait on the end event; on CPU a host clock."""
    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure_matmul(device: str, n: int, reps: int = 20, warmup: int = 3) -> dict:
    """Median bf16 n x n x n matmul rate on random data, rotating three input pairs (METHOD.md)."""
    import torch

    cuda = device == "cuda"
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(n, n, generator=gen).to(device, torch.bfloat16),
              torch.randn(n, n, generator=gen).to(device, torch.bfloat16)) for _ in range(3)]
    times = []
    for i in range(warmup + reps):
        a, b = pairs[i % 3]
        t, _ = timed(lambda: a @ b, cuda)
        if i >= warmup:
            times.append(t)
    med = median(times)
    return {"n": n, "reps": reps, "median_s": med, "tflops": 2 * n**3 / med / 1e12}


def peak_memory_gib(device: str) -> dict:
    import torch

    if device == "cuda":
        return {"peak_gib": torch.cuda.max_memory_allocated() / GIB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB, "memory_kind": "cuda max allocated"}
    import resource

    return {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_reserved_gib": None,
            "memory_kind": "process max RSS (cpu dry run)"}


def is_oom(exc: BaseException) -> bool:
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


# Autograd functions and ops whose inclusive time is a layer's (forward and backward apart): the loss head, the
# recomputed layers, attention.
LAYER_OPS = ("_ChunkedLinearCrossEntropy", "_VocabParallelCrossEntropy", "CheckpointFunction",
             "scaled_dot_product", "flash_attention", "efficient_attention")


def profile_step(stack, batch: dict, device: str, path: Path, title: str) -> dict:
    """One step under torch.profiler: top kernels appended to `path` under `title` (one file for all profiles
    of a run: the device tool returns 8 files at most), device time per kernel bucket to the JSON."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        stack.step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    cuda = device == "cuda"
    self_key, total_key = ("self_device_time_total", "device_time_total") if cuda else \
        ("self_cpu_time_total", "cpu_time_total")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Self time names the kernels; inclusive time of the ops (CPU-side events, their kernels included)
    # names the layers: the loss (_ChunkedLinearCrossEntropy, or _VocabParallelCrossEntropy), attention, recompute (CheckpointFunction).
    with path.open("a") as f:
        f.write(f"#### {title}\n== by self time ({self_key})\n"
                + events.table(sort_by=self_key, row_limit=30, max_name_column_width=90)
                + f"\n== by inclusive time ({total_key})\n"
                + events.table(sort_by=total_key, row_limit=40, max_name_column_width=90) + "\n\n")
    ops = sorted(((e.key, getattr(e, total_key)) for e in events
                  if not str(getattr(e, "device_type", "")).endswith("CUDA") and getattr(e, total_key) > 0),
                 key=lambda kv: -kv[1])
    # the layers named whatever their rank: at toy size the loss may fall out of the top 25 on a busy machine
    layers = {name: us for name, us in ops if any(marker in name for marker in LAYER_OPS)}
    ops = ops[:25]
    if cuda:
        kernels = [(e.key, e.self_device_time_total) for e in events
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.self_device_time_total > 0]
    else:
        kernels = [(e.key, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0]
    buckets = bucket_kernels(kernels)
    total = sum(buckets.values()) or 1.0
    return {"file": path.name, "section": f"#### {title}", "unit": "device us" if cuda else "cpu us (self time of ops)",
            "total_us": total, "share": {k: v / total for k, v in buckets.items()},
            "top_ops_inclusive_us": [[name, us] for name, us in ops], "layers_inclusive_us": layers}
