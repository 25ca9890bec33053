"""Runtime: distributed init (torchrun or Slurm), device choice, and the CPU backend."""

from megatron_ext.runtime.distributed import (
    DeviceError,
    ProcessEnv,
    destroy_distributed,
    first_host,
    init_distributed,
    process_env,
    rank_device,
)


def te_available() -> bool:
    """True when Transformer Engine's PyTorch extension imports."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


__all__ = ["DeviceError", "ProcessEnv", "destroy_distributed", "first_host", "init_distributed", "process_env",
           "rank_device", "te_available"]
