"""Pins of megatron_ext.runtime.cpu_backend found by mutation audit round 7 (its docstring says what each patch
answers): the ways Megatron-Core names a CUDA device all land on the CPU, the CPU path sees no GPU, the RNG tracker
keeps the CUDA tracker's refusals, and applying the backend again (each `init_distributed`) changes nothing."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)])
def test_every_spelling_of_a_cuda_device_lands_on_the_cpu(device, cpu_parallel_state):
    """`device="cuda:0"` and torch.device("cuda", i) are what code that took `torch.cuda.current_device()` or a local
    rank passes; `.to(...)` and `.cuda()` move batches; `pin_memory=True` is asked of CP RoPE's index buffers."""
    assert torch.zeros(2, device=device).device.type == "cpu"
    assert torch.ones(2).to(device).device.type == "cpu"
    t = torch.ones(2)
    assert t.cuda() is t and t.pin_memory() is t
    assert torch.empty(2, pin_memory=True).device.type == "cpu"


def test_the_cpu_path_sees_no_gpu(cpu_parallel_state):
    """Code that picks `local_rank % device_count()` or loops over the devices must find none."""
    assert torch.cuda.device_count() == 0 and not torch.cuda.is_available()


def test_the_rng_tracker_keeps_the_cuda_trackers_refusals(cpu_parallel_state):
    """Megatron-Core's CudaRNGStatesTracker refuses a seed or a name twice and a fork of a state never added: two
    parallel groups seeded alike, or dropout drawn from a state nobody seeded, must not pass silently on CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()  # the CPU tracker, as the backend installed it
    tracker.add("a", 1)
    with pytest.raises(Exception, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="rng state a already exists"):
        tracker.add("a", 2)
    with pytest.raises(Exception, match="rng state c is not added"):
        with tracker.fork("c"):
            pass
    with tracker.fork("a"):
        pass
    assert tracker.is_initialized()


def test_applying_the_backend_again_changes_nothing(cpu_parallel_state):
    """`init_distributed` applies it at every start (a test session, the converter's --verify after a load): a second
    application reset the seeded RNG tracker and started another results queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_ext.runtime.cpu_backend import apply_cpu_backend, cpu_backend_applied

    names = set(mrandom.get_cuda_rng_tracker().get_states())
    queue = filesystem_async._get_write_results_queue()
    assert names and queue is filesystem_async._get_write_results_queue()  # one queue for the process
    apply_cpu_backend()
    assert cpu_backend_applied()
    assert set(mrandom.get_cuda_rng_tracker().get_states()) == names
    assert filesystem_async._get_write_results_queue() is queue
