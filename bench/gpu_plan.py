"""What bench/gpu_throughput.py plans for the GPU it runs on: the GPU's figures (`bench_gpu`) and, from
`megatron_ext.plan`, the memory of each of our rows, the layers a fallback row keeps and the `full:N` rows.
An H100 (80 GB) and an H200 (141 GB) differ in all three at the lengths the benchmark runs."""

from __future__ import annotations

import dataclasses

from bench.report import GIB
from bench.stacks import Settings, make_recipe


def bench_gpu(s: Settings):
    """The `cost_model.GPU` the run plans memory for and counts MFU against, and where it came from: `--gpu`, else
    the CUDA device's name (an H100 has 80 GB where an H200 has 141: the planner's fallback and partial-recompute
    choices differ), else, for a device the table lacks, the H100/H200 peak with the device's own memory."""
    import torch

    from megatron_ext.cost_model import GPUS, gpu_from_device_name

    if s.device != "cuda":
        return GPUS[s.gpu or "h200-141gb"], "a CPU run: planned as on this GPU"
    if s.gpu is not None:
        return GPUS[s.gpu], "--gpu"
    name = torch.cuda.get_device_name()
    known = gpu_from_device_name(name)
    if known is not None:
        return known, f"from the device name {name!r}"
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 / 1.07  # nvidia-smi's bytes, marketed GB
    return (dataclasses.replace(GPUS["h200-141gb"], name=name, memory_gb=memory_gb),
            f"{name!r} is not in cost_model.GPUS: its memory, the H100/H200 peak (MFU against the datasheet is "
            "meaningless if this is another chip)")


def plan_row(s: Settings, gpu, length: int, recompute: str):
    """megatron_ext.plan's plan of our stack with `s.layers` at `length` on `gpu`."""
    from megatron_ext.plan import plan

    r = make_recipe(s, recompute)
    return plan(dataclasses.replace(r, train=dataclasses.replace(r.train, seq_length=length)), gpu, gpus=1)


def planned_memory(s: Settings, gpu, length: int, recompute: str) -> dict:
    """The planner's memory of our stack at this length, to compare with the measured peak (a diagnostic)."""
    try:
        m = plan_row(s, gpu, length, recompute).memory
        return {"total_gib": m.total / GIB, "without_overhead_gib": (m.total - m.overhead) / GIB,
                "logits_gib": m.logits / GIB, "activations_gib": m.activations / GIB,
                "states_gib": (m.weights + m.grads + m.optimizer) / GIB}
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def _fits(p) -> bool:  # within 90% of the GPU
    return p.fits and not p.tight


def partial_layers(s: Settings, gpu, length: int) -> int | None:
    """Fewest first layers to recompute (`full:N`) that the planner fits in 90% of the GPU at `length`, or None."""
    return next((n for n in range(1, s.layers) if _fits(plan_row(s, gpu, length, f"full:{n}"))), None)


def auto_fallback_layers(s: Settings, gpu, length: int, recompute: str) -> int:
    """The most layers (fewer than `s.layers`, at least 1) that the planner fits in 90% of the GPU at `length`:
    `--fallback-layers auto` (an H100 holds 128K of this model at fewer layers than an H200)."""
    return next((n for n in range(s.layers - 1, 0, -1)
                 if _fits(plan_row(dataclasses.replace(s, layers=n), gpu, length, recompute))), 1)
