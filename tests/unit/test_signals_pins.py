"""Pins of megatron_ext.runtime.signals found by mutation audit round 7: contracts its docstrings state that no
other test held (a SIGTERM at a tool's exit, a disposition set inside the block, a forked child after a block of
its own, the rank that reports an interrupt at the start)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

from megatron_ext.runtime.job_env import process_env
from megatron_ext.runtime.signals import Terminated, interrupted_as_it_started, sigterm_as_interrupt
from tests.conftest import ROOT

# A tool's script after its main() returned: both signals while Python exits must change nothing. Run in a process
# of its own: ignoring them here would make the test session (and all it starts) ignore them too.
AFTER_MAIN = """
import os, signal
from megatron_ext.runtime.signals import exit_after_main
try:
    exit_after_main(3)
finally:  # while the interpreter exits, as torch's teardown takes a second
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
"""


def test_neither_sigterm_nor_ctrl_c_changes_a_finished_tools_exit():
    """scancel at the end of a run ended a complete command with -15 where only Ctrl-C was ignored."""
    proc = subprocess.run([sys.executable, "-c", AFTER_MAIN], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT)}, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 3 and proc.stderr == "", (proc.returncode, proc.stderr)


def test_an_ignore_set_inside_the_block_outlives_it():
    """The docstring: the previous dispositions come back after the block unless the block set its own. Restoring
    them over `ignore_interrupts_from_now` would bring the -2 / -15 of an interrupted exit back."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    try:
        with sigterm_as_interrupt():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what ignore_interrupts_from_now does, for SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _block_then_wait(ready, go) -> None:
    """A forked helper that ran a `sigterm_as_interrupt` block of its own, then waits (as a checkpoint writer)."""
    with sigterm_as_interrupt():
        pass
    ready.set()
    go.wait(30)


def test_a_forked_child_that_ran_a_block_of_its_own_still_ignores_the_signals():
    """Inside its own block a forked child is its block's owner; after it, it is again a helper of the process that
    forked it, whose signal it gets too (scancel, Ctrl-C): dying on it hangs the owner's queue protocol."""
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    with sigterm_as_interrupt():
        child = ctx.Process(target=_block_then_wait, args=(ready, go))
        child.start()
    try:
        assert ready.wait(30)
        os.kill(child.pid, signal.SIGTERM)
        child.join(0.5)  # a child that raised is gone well within this
        assert child.is_alive(), child.exitcode
    finally:
        go.set()
        child.join(30)
    assert child.exitcode == 0


@pytest.mark.parametrize("env", [
    {},
    {"RANK": "0", "WORLD_SIZE": "2"},
    {"RANK": "1", "WORLD_SIZE": "2"},
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
    # torchrun inside a Slurm job of one task per node: every rank on the first node has SLURM_PROCID 0
    {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
    {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
])
def test_the_rank_that_reports_an_interrupt_at_the_start_is_the_jobs_rank_0(env, monkeypatch, capsys):
    """One line per job, from the rank the rest of the project calls 0 (`process_env`: torchrun's RANK wins)."""
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert interrupted_as_it_started(Terminated()) == 143
    said = capsys.readouterr().err
    assert (said != "") == (process_env().rank == 0), (env, said)
    if said:
        assert said == "error: interrupted (SIGTERM) as the command started; nothing was done: run it again\n"


def test_an_interrupt_two_causes_down_is_found():
    """`interrupt_behind` walks the whole chain of causes: a library that wraps an already wrapped interrupt (a
    RuntimeError of Python's `__set_name__` around it, re-raised by a loader `from` that) still stands for it."""
    from megatron_ext.runtime.signals import interrupt_behind

    stop = Terminated("received signal SIGTERM")
    inner = RuntimeError("class body failed")
    inner.__cause__ = stop
    outer = ValueError("load failed")
    outer.__cause__ = inner
    assert interrupt_behind(outer) is stop
    plain = ValueError("load failed")
    plain.__cause__ = RuntimeError("not an interrupt")
    assert interrupt_behind(plain) is None  # control: a chain without one


def _sleep(ready) -> None:
    ready.set()
    signal.pause()


def test_an_interrupt_leaves_the_children_started_before_the_block():
    """Only the helpers the block started are killed: a process started before it (the checkpoint writers' results
    queue, forked when the CPU backend is applied) is not the block's to stop."""
    from megatron_ext.runtime.signals import children_killed_on_interrupt

    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    before = ctx.Process(target=_sleep, args=(ready,))
    before.start()
    try:
        assert ready.wait(30)
        with pytest.raises(Terminated), sigterm_as_interrupt(), children_killed_on_interrupt():
            signal.raise_signal(signal.SIGTERM)
        assert before.is_alive()
    finally:
        before.kill()
        before.join(30)


def _started_by_fork() -> int:
    """A helper started without multiprocessing (os.fork, as a library's own writer could be)."""
    pid = os.fork()
    if pid == 0:
        try:
            signal.pause()
        finally:
            os._exit(0)
    return pid


def test_a_child_started_without_multiprocessing_is_killed_and_reaped():
    """The block's end leaves no such child running or unreaped: the caller's cleanup (removing the folder it wrote
    to) may start at once."""
    from megatron_ext.runtime.signals import children_killed_on_interrupt

    pid = None
    try:
        with pytest.raises(Terminated), sigterm_as_interrupt(), children_killed_on_interrupt():
            pid = _started_by_fork()
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(ChildProcessError):  # reaped already: nothing left to wait for
            os.waitpid(pid, os.WNOHANG)
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _raise_wrapped(sig: int) -> None:
    try:
        signal.raise_signal(sig)
    except BaseException as e:  # torch.distributed.checkpoint turns it into a CheckpointException
        raise RuntimeError("checkpoint planning failed") from e


class _Swallows:
    def __init__(self, sig: int):
        self.sig = sig

    def __del__(self):  # Python prints an exception raised here and goes on, as in an at-fork hook
        signal.raise_signal(self.sig)


@pytest.mark.parametrize("earlier, now, expected", [(signal.SIGINT, signal.SIGTERM, Terminated),
                                                    (signal.SIGTERM, signal.SIGINT, KeyboardInterrupt)])
def test_a_lost_interrupt_is_the_latest_signal_not_an_earlier_one(earlier, now, expected, monkeypatch):
    """A wrapped or swallowed interrupt is raised as the signal that caused it (its exit status, 143 or 130), not as
    one the process got and handled before."""
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    # Python's own Ctrl-C handler, which a Python started with SIGINT ignored (any `cmd &` in a script, as a CI
    # runner may start pytest) never installs: SIGINT would then raise nothing
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _lose_each_way(earlier, now, expected)
    finally:
        signal.signal(signal.SIGINT, previous)


def _lose_each_way(earlier: int, now: int, expected: type) -> None:
    from megatron_ext.runtime.signals import interrupts_unwrapped

    for lose_it in (lambda: _raise_wrapped(now), lambda: _Swallows(now)):
        with sigterm_as_interrupt():
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(earlier)  # handled: a tool that went on after it
            with pytest.raises(KeyboardInterrupt) as raised, interrupts_unwrapped():
                lose_it()
        assert type(raised.value) is expected, type(raised.value)
