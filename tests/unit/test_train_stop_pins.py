"""megatron_ext.train_stop pinned where the mutation audit (round 6) found it untested in one process: the flag a
signal sets, the Ctrl-C window, the agreement's values, the unsaved stop's line, and the start-up handlers (in a
child process: they end it).

The handlers are called as Python calls them (signum, frame); the Ctrl-C clock is a fake one, so that 'later than
SECOND_CTRL_C_S' needs no sleeping. The real process-wide handlers are restored after each test."""

from __future__ import annotations

import signal
import subprocess
import sys
import types

import pytest

from megatron_ext import train_stop
from megatron_ext.train_stop import EXIT_INTERRUPTED, StopFlag, any_rank, say_stopped_unsaved
from tests.conftest import ROOT

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture
def handlers():
    """The test process's own handlers, put back after the test (StopFlag installs its own, settle ignores all)."""
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def clock(monkeypatch):
    """train_stop's monotonic clock, moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(train_stop, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_every_stop_signal_is_handled_and_settle_ignores_them(handlers):
    """SIGTERM (scancel), SIGUSR1 (Slurm's warning), SIGUSR2 (the batch shell's stop) set the flag and do not raise;
    after settle every one of them, and Ctrl-C, is ignored."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        stop = StopFlag()
        assert signal.getsignal(sig) == stop._handle and signal.getsignal(signal.SIGINT) == stop._handle
        stop._handle(sig, None)
        assert stop.signal == sig and stop.interrupted_at is None
    stop.settle()
    assert all(signal.getsignal(s) == signal.SIG_IGN for s in SIGNALS)


def test_ctrl_c_before_the_loop_stops_at_once(handlers, clock):
    stop = StopFlag()
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)


def test_ctrl_c_in_the_loop_saves_and_only_a_later_second_one_stops_unsaved(handlers, clock, capsys):
    """torchrun passes a terminal's Ctrl-C on to its workers: the second copy, within milliseconds, and another
    within SECOND_CTRL_C_S (2 s) of the first, change nothing; one later than that after the FIRST stops unsaved
    (also when a Ctrl-C in between came sooner)."""
    stop = StopFlag()
    stop.in_loop = True
    stop._handle(signal.SIGINT, None)
    assert stop.signal == signal.SIGINT and stop.interrupted_at == 1000.0
    assert "Ctrl-C: finishing this step and saving (Ctrl-C again to stop without saving)" in capsys.readouterr().out
    clock[0] += 0.001
    stop._handle(signal.SIGINT, None)  # torchrun's copy
    clock[0] += 1.0
    stop._handle(signal.SIGINT, None)  # within 2 s of the first
    assert stop.interrupted_at == 1000.0 and capsys.readouterr().out == ""  # said once
    clock[0] = 1000.0 + StopFlag.SECOND_CTRL_C_S + 0.5  # 1.5 s after the last, 2.5 s after the first
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)


def test_agreed_says_whether_and_how_the_run_was_stopped(handlers, cpu_parallel_state, clock):
    """One rank: nothing -> no stop; a stop signal -> stop, not interrupted (the requeue exit); a Ctrl-C in the
    loop -> stop, interrupted (exit 130)."""
    stop = StopFlag()
    assert stop.agreed() is False and stop.interrupted_anywhere is False
    stop._handle(signal.SIGUSR1, None)
    assert stop.agreed() is True and stop.interrupted_anywhere is False
    stop.in_loop = True
    stop._handle(signal.SIGINT, None)
    assert stop.agreed() is True and stop.interrupted_anywhere is True
    assert any_rank(True) is True and any_rank(False) is False


def test_the_unsaved_stop_is_said_once_on_the_first_rank(monkeypatch, capsys):
    """By the launcher's variables: torchrun's RANK, else Slurm's SLURM_PROCID; a launcher that sets neither is
    one process."""
    for env, said in (({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False), ({"SLURM_PROCID": "3"}, False),
                      ({"SLURM_PROCID": "0"}, True), ({"RANK": "0", "SLURM_PROCID": "2"}, True)):
        for key in ("RANK", "SLURM_PROCID"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        say_stopped_unsaved(in_loop=False)
        err = capsys.readouterr().err
        assert ("[train] interrupted (Ctrl-C) before the first step: nothing trained or saved" in err) == said, env
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    say_stopped_unsaved(in_loop=True)
    err = capsys.readouterr().err
    assert "stopped without saving; the newest checkpoint in checkpoint.dir is where" in err and "before the first" \
        not in err


# The start-up handlers in a child process (they end it): signals sent to itself, then what StopFlag found.
_STARTING = """
import os, signal, sys
from megatron_ext.train_stop import StopFlag, catch_signals_while_starting
catch_signals_while_starting()
for name in sys.argv[1:]:
    os.kill(os.getpid(), getattr(signal, name))
print("kept", signal.Signals(StopFlag().signal).name if StopFlag().signal else None, flush=True)
"""


@pytest.mark.parametrize("sent", [["SIGTERM"], ["SIGUSR1"], ["SIGUSR2"], ["SIGTERM", "SIGUSR1"]])
def test_a_stop_signal_while_starting_is_kept_for_the_flag(sent):
    """Sent during the imports (before StopFlag), a stop signal neither ends the process (its default action) nor
    is lost: the flag starts set to it (the latest, when several came)."""
    proc = subprocess.run([sys.executable, "-c", _STARTING, *sent], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout == f"kept {sent[-1]}\n", proc.stdout + proc.stderr


def test_ctrl_c_while_starting_is_one_line_and_exit_130():
    proc = subprocess.run([sys.executable, "-c", _STARTING, "SIGINT"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == EXIT_INTERRUPTED == 130 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith("[train] interrupted (Ctrl-C) before the first step: nothing "
                                                 "trained or saved; the same command starts again (from the newest "
                                                 "checkpoint in checkpoint.dir, if there is one)"), proc.stderr
