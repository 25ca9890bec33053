"""Distributed initialisation from torchrun or Slurm environment, and Megatron parallel state."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any, Callable, Mapping, TypeVar

import torch

from megatron_ext.runtime.job_env import DeviceError, ProcessEnv, process_env

E = TypeVar("E", bound=BaseException)


def rank_device() -> torch.device:
    """This rank's device: its GPU under runtime.device cuda (after `init_distributed` chose it), else the CPU (a CPU
    run hides the GPUs, `cpu_backend.py`). Batches and the tensors of collectives go there: NCCL takes only CUDA
    tensors, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def tasks_on_this_node(environ: Mapping[str, str] | None = None) -> int | None:
    """How many tasks of this job step run on this node (torchrun's LOCAL_WORLD_SIZE, or Slurm's tasks-per-node list
    at this node's index: `8(x4)`, `8,4`, `4(x2),2`), None where neither says."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun's variables win, as in process_env
        return int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE", "").isdigit() else None
    spec, node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"), env.get("SLURM_NODEID")
    if not spec or node is None or not node.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def gpu_of_local_rank(local_rank: int, visible: int, tasks_on_node: int | None) -> int:
    """The index, among the GPUs this task sees, of the one it uses. A task sees all the node's GPUs (one each by
    local rank) or exactly one (`--gpus-per-task=1`); between the two (`--gpu-bind=closest` hands each task its
    NUMA domain's GPUs, and Slurm's cyclic placement puts local ranks 0 and 4 in one domain) two ranks would take
    the same GPU: out of memory, or half the speed without a word. That is a DeviceError."""
    if tasks_on_node is not None and 1 < visible < tasks_on_node:
        raise DeviceError(
            f"this task sees {visible} GPUs (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}) "
            f"and {tasks_on_node} tasks share the node: local rank {local_rank} would share GPU "
            f"{local_rank % visible} with another task; give every task all of the node's GPUs (--gpus-per-node, "
            "without --gpu-bind) or one each (--gpus-per-task=1)")
    return local_rank % visible


def port_in_use(penv: ProcessEnv) -> str:
    """What rank 0 says when another process holds the rendezvous port, and the fix for how the job was started."""
    fix = {"torchrun": "give torchrun another --master_port",
           "slurm": "export MASTER_PORT=<a free port below 32768> before srun (the default is derived from the job "
                    "id, and another job on this node holds it)"}.get(
        penv.launcher, "unset MASTER_PORT (a free port is then chosen) or export a free one")
    return (f"rendezvous port {penv.master_addr}:{penv.master_port} (MASTER_PORT) is in use by another process; "
            f"{fix}")


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
        torch.cuda.set_device(gpu_of_local_rank(penv.local_rank, torch.cuda.device_count(), tasks_on_this_node()))
        backend = "nccl"
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        # The address goes in init_method, not into os.environ: a program that starts others after this (a test
        # suite, a notebook) would hand them a port its own store still holds after destroy_distributed.
        try:
            torch.distributed.init_process_group(
                backend=backend,
                init_method=f"tcp://{penv.master_addr}:{penv.master_port}",
                rank=penv.rank,
                world_size=penv.world_size,
                timeout=timedelta(minutes=timeout_minutes),
            )
        except torch.distributed.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            raise DeviceError(port_in_use(penv)) from None
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


def alike_on_every_rank(error: E) -> E:
    """`error` marked as raised alike by every rank (from a `rank_zero_outcome` problem): an entry point says it once,
    from rank 0, where 512 ranks would print 512 copies of one line."""
    error.alike_on_every_rank = True
    return error


def is_alike_on_every_rank(error: BaseException) -> bool:
    """Whether `error` was marked by `alike_on_every_rank`."""
    return getattr(error, "alike_on_every_rank", False) is True


def rank_zero_outcome(fn: Callable[[], Any], expected: type[Exception]) -> tuple[Any, str | None]:
    """`fn()` run by rank 0 alone, its outcome on every rank: (value, None), or (None, message) where it raised.

    For checks every rank would make alike on a shared file system (512 ranks opening the same files): one does, and
    all raise the same error. The message of an `expected` error is its text; of any other, `rank 0: Type: text`,
    sent too so that no rank waits in the broadcast for a value that never comes, and rank 0 raises that one as it
    is. Collective; without a process group the caller is rank 0. Raise the message's error through
    `alike_on_every_rank`, so that it is said once.
    """
    outcome, error = [None, None], None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        try:
            outcome[0] = fn()
        except Exception as e:
            outcome[1] = str(e) if isinstance(e, expected) else f"rank 0: {type(e).__name__}: {e}"
            error = None if isinstance(e, expected) else e
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    return outcome[0], outcome[1]
