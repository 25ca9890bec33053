"""P0 of the CPU backend (`megatron_ext/runtime/cpu_backend.py` says why): Transformer Engine and Apex kept out of
a CPU-only process before Megatron-Core is imported. Apart from the backend because it must import no torch: the
CPU-only tools (converter, demo) apply it when they start, and their --help does not wait for torch.
"""

from __future__ import annotations

import sys

from megatron_ext.runtime.job_env import DeviceError

# P0: what Megatron-Core 0.16.1 imports, each in a try/except ImportError, to pick GPU kernels
_GPU_PACKAGES = ("transformer_engine", "transformer_engine_torch", "apex", "amp_C", "fused_weight_gradient_mlp_cuda")


# What Megatron-Core's import says where Transformer Engine or Apex is missing (category, message, module), as
# warnings.filterwarnings takes them: news only to a process that runs Megatron's layers or optimizer (the trainer,
# the Megatron engine); a converter, or quantize.py (nvidia-modelopt imports Megatron-Core for its plugins), does not.
MEGATRON_FALLBACK_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back to ", r"megatron\.core\."),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\."),
)


def hide_megatron_fallback_warnings() -> None:
    """Hide MEGATRON_FALLBACK_WARNINGS for the rest of the process (for tools that run none of Megatron's layers)."""
    import warnings

    for category, message, module in MEGATRON_FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def hide_gpu_packages() -> None:
    """P0 (idempotent): Transformer Engine and Apex do not import in this process, so that Megatron-Core, imported
    after, takes its torch code. DeviceError when one is already imported (Megatron may have chosen its kernels)."""
    loaded = [name for name in _GPU_PACKAGES if sys.modules.get(name) is not None]
    if loaded:
        raise DeviceError(f"runtime.device = 'cpu' in a process that has already imported {', '.join(loaded)}: "
                          "Megatron-Core would run its CUDA kernels on CPU tensors; run the CPU path in its own "
                          "process, or use runtime.device=cuda")
    for name in _GPU_PACKAGES:
        sys.modules[name] = None  # type: ignore[assignment]
