"""Distributed initialisation from torchrun or Slurm environment, and Megatron parallel state."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from megatron_ext.runtime.job_env import DeviceError, ProcessEnv, process_env


def rank_device() -> torch.device:
    """This rank's device: its GPU under runtime.device cuda (after `init_distributed` chose it), else the CPU (a CPU
    run hides the GPUs, `cpu_backend.py`). Batches and the tensors of collectives go there: NCCL takes only CUDA
    tensors, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(
    device: str,
    tensor: int = 1,
    pipeline: int = 1,
    context: int = 1,
    hierarchical_context_sizes: tuple[int, ...] | None = None,
    seed: int = 1234,
    timeout_minutes: int = 30,
) -> ProcessEnv:
    """Create the default process group (NCCL on cuda, gloo on cpu) and Megatron's TP/PP/CP/DP groups.

    On cpu the CPU backend is applied first. Idempotent for the default group.
    """
    penv = process_env()
    if device == "cpu":
        from megatron_ext.runtime.cpu_backend import apply_cpu_backend

        apply_cpu_backend()  # before Megatron-Core is imported (P0)
        backend = "gloo"
    else:
        if tensor > 1 or context > 1:
            # Megatron's TP/SP and CP communication overlap assumes kernels start in issue order (one hardware
            # queue); read when the CUDA context is made, so before set_device. slurm/common.sh sets it as well.
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        if not torch.cuda.is_available():
            raise DeviceError("runtime.device = 'cuda' but no CUDA device is visible; use runtime.device=cpu")
        torch.cuda.set_device(penv.local_rank % torch.cuda.device_count())
        backend = "nccl"
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", penv.master_addr)
        os.environ.setdefault("MASTER_PORT", str(penv.master_port))
        torch.distributed.init_process_group(
            backend=backend,
            init_method=f"tcp://{penv.master_addr}:{penv.master_port}",
            rank=penv.rank,
            world_size=penv.world_size,
            timeout=timedelta(minutes=timeout_minutes),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        context_parallel_size=context,
        hierarchical_context_parallel_sizes=list(hierarchical_context_sizes) if hierarchical_context_sizes else None,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return penv


def destroy_distributed() -> None:
    """Tear down Megatron parallel state and the default group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
