"""Runtime: distributed init (torchrun or Slurm), device choice, and the CPU backend."""

# Lazy (PEP 562): the tools read the job's ranks and report errors before torch is imported (`--help` and argument
# mistakes answer at once); runtime.distributed needs torch.
_HOME = {**dict.fromkeys(("DeviceError", "ProcessEnv", "first_host", "free_port", "process_env"), "job_env"),
         **dict.fromkeys(("destroy_distributed", "init_distributed", "rank_device"), "distributed")}


def __getattr__(name: str):
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"megatron_ext.runtime.{_HOME[name]}"), name)
    raise AttributeError(f"module 'megatron_ext.runtime' has no attribute {name!r}")


def te_available() -> bool:
    """True when Transformer Engine's PyTorch extension imports."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


__all__ = [*_HOME, "te_available"]
