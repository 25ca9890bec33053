"""Ctrl-C or SIGTERM while a checkpoint is read reaches the caller as the interrupt (KeyboardInterrupt, or
`Terminated` under `sigterm_as_interrupt`), not as torch.distributed.checkpoint's CheckpointException, which
wraps any exception of its planning and reading: the tools then printed a long traceback and exited 1 instead of
their one `error: interrupted` line and 130 / 143."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

from megatron_ext.checkpoint import load_checkpoint, save_checkpoint
from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY
from megatron_ext.runtime.signals import Terminated, sigterm_as_interrupt


@pytest.fixture(scope="module")
def saved(tmp_path_factory, cpu_parallel_state):
    root = tmp_path_factory.mktemp("interrupted_load") / "ckpt"
    torch.manual_seed(0)
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})
    return root


@pytest.fixture
def signal_while_reading(monkeypatch):
    """The process signals itself from inside torch.distributed.checkpoint's read of the shard data: the
    signal arrives, as a user's would, while the load runs (deterministically, at every load)."""
    sent = []

    def arm(signum: int) -> list:
        original = FileSystemReader.read_data

        def read_data(self, plan, planner):
            sent.append(signum)
            os.kill(os.getpid(), signum)  # delivered at the next bytecode, inside the reader
            return original(self, plan, planner)

        monkeypatch.setattr(FileSystemReader, "read_data", read_data)
        return sent

    return arm


def _model():
    return build_model(TINY, BuildOptions(device="cpu", seq_length=32))


def test_sigterm_during_load_checkpoint_is_terminated(saved, signal_while_reading):
    sent = signal_while_reading(signal.SIGTERM)
    model = _model()
    with pytest.raises(Terminated, match="SIGTERM"):
        with sigterm_as_interrupt():
            load_checkpoint(saved, [model], weights_only=True)
    assert sent == [signal.SIGTERM]


def test_ctrl_c_during_load_checkpoint_is_keyboard_interrupt(saved, signal_while_reading):
    """Python's own SIGINT handler (no `sigterm_as_interrupt`: a library caller). Set here: a test run started in the
    background (CI) has SIGINT ignored, and Python then installs no handler of its own."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_during_load(saved, signal_while_reading)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_during_load(saved, signal_while_reading) -> None:
    sent = signal_while_reading(signal.SIGINT)
    model = _model()
    with pytest.raises(KeyboardInterrupt) as caught:
        load_checkpoint(saved, [model], weights_only=True)
    assert type(caught.value) is KeyboardInterrupt and sent == [signal.SIGINT]


def test_sigterm_during_a_streamed_read_is_terminated(saved, signal_while_reading):
    """The converter's layer-by-layer reader (to-hf, its --verify) reads with torch.distributed.checkpoint too."""
    from megatron_ext.convert.dist_reader import TorchDistReader

    reader = TorchDistReader(saved / "iter_0000001")
    key = next(iter(reader.tensors))
    assert reader.read([key])[key].shape == reader.shape(key)  # unarmed: reads
    sent = signal_while_reading(signal.SIGTERM)
    with pytest.raises(Terminated):
        with sigterm_as_interrupt():
            reader.read([key])
    assert sent == [signal.SIGTERM]


def test_other_read_errors_still_surface(saved, monkeypatch):
    """Only interrupts are unwrapped: a failing read stays torch's CheckpointException (with its cause)."""
    from torch.distributed.checkpoint.api import CheckpointException

    def read_data(self, plan, planner):
        raise OSError("disk gone")

    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    with pytest.raises(CheckpointException, match="disk gone"):
        load_checkpoint(saved, [_model()], weights_only=True)
