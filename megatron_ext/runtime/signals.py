"""SIGTERM as Ctrl-C for the command-line tools (conversion, evaluation, quantisation).

Slurm's `scancel` and its time limit, and a plain `kill`, send SIGTERM, whose default action ends the
process at once: the cleanup that runs on Ctrl-C (removing a half-written output's temporary folder)
never runs, and a full-size hidden copy stays behind per attempt. The trainer has its own handler
(`megatron_ext.train_stop.StopFlag`: finish the step, save, exit for requeue); this one is for the tools.

Only the process that installed the handler raises. `scancel` and Ctrl-C signal every process of the job
step or terminal, and processes forked from a tool inherit its handlers: Megatron-Core's checkpoint writers
(forked at each save) died halfway through their queue protocol, and the tool then waited for their results
forever. In them the signal now does nothing; the tool stops them (`children_killed_on_interrupt`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, NoReturn

_owner_pid: int | None = None  # the process inside `sigterm_as_interrupt`; its forked children have other pids
_received: list[int] = []  # signals that raised in the owner, oldest first


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM."""


def _interrupt_for(signum: int) -> KeyboardInterrupt:
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return Terminated(f"received signal {signal.Signals(signum).name}")


def _interrupt(signum: int, frame) -> None:
    if os.getpid() != _owner_pid:
        return  # a forked helper: the owner got the same signal and stops it
    _received.append(signum)
    raise _interrupt_for(signum)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread, so `finally` blocks
    and `except KeyboardInterrupt` cleanups run as on Ctrl-C; SIGINT raises KeyboardInterrupt as before. In
    processes forked inside the block both signals do nothing (see the module docstring). A handler someone else
    installed stays (submitit's, when the launcher runs a tool in-process), and the previous dispositions come
    back after the block (tests call the tools' `main` in-process), unless the block set its own
    (`ignore_interrupts_from_now`). Off the main thread nothing changes (Python delivers signals there only).

    An interrupt that something in the block turned into another exception leaves it as the interrupt again
    (`_interrupt_within`): Python 3.11 wraps one raised in a class body's `__set_name__` in a RuntimeError, so a
    Ctrl-C during a first `import matplotlib` (niah's heatmap, after a length was saved) was a traceback, exit 1.
    """
    global _owner_pid
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    ours = [s for s, default in defaults.items() if signal.getsignal(s) is default]
    previous_owner, _owner_pid = _owner_pid, os.getpid()
    seen = len(_received)
    for s in ours:
        signal.signal(s, _interrupt)
    try:
        yield
    except Exception as e:  # not SystemExit: a tool's `sys.exit` after an interrupt it reported stays itself
        interrupt = _interrupt_within(e, seen)
        if interrupt is None:
            raise
        raise interrupt from e
    finally:
        for s in ours:
            if signal.getsignal(s) is _interrupt:
                signal.signal(s, defaults[s])
        _owner_pid = previous_owner


def ignore_interrupts_from_now() -> None:
    """A command's outputs are complete: Ctrl-C and SIGTERM are ignored for the rest of the process, so that they
    change neither its exit status nor what it printed. Python restores a handled signal's default action as it
    exits, and the exit of a tool that imported torch and Megatron-Core takes a second (their helper processes):
    a Ctrl-C there ended a complete command with status -2 and no word. For the end of a command's process (in a
    `sigterm_as_interrupt` block it stays after the block); main thread only, elsewhere a no-op. Call it from the
    process's entry point (`if __name__ == "__main__"`), never from a `main()` that is also called in-process: the
    caller (a test session) would ignore both signals from then on, and every process it starts would inherit that
    (SIG_IGN survives exec; `sigterm_as_interrupt` leaves an ignored signal alone)."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def interrupted_as_it_started(e: KeyboardInterrupt, nothing: str = "nothing was done") -> int:
    """Print the one line of a command stopped before its work began (rank 0 of a torchrun / srun job only: every
    rank gets the signal); the exit status a shell gives it (143 SIGTERM, 130 Ctrl-C)."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        print(f"error: interrupted ({how}) as the command started; {nothing}: run it again", file=sys.stderr,
              flush=True)
    return 143 if isinstance(e, Terminated) else 130


def main_imported(module: str) -> Callable[..., int]:
    """`module`.main for a tool's script (tools/*.py), imported with Ctrl-C and SIGTERM held
    (`held_signals.interrupts_held`): a module that imports numpy or torch as it loads was a bare KeyboardInterrupt
    traceback (exit -2), or a silent -15, for a signal in its first moments. One that comes in the import now ends
    the process with `interrupted_as_it_started`'s line."""
    import importlib

    from megatron_ext.runtime.held_signals import interrupts_held

    try:
        with sigterm_as_interrupt(), interrupts_held():
            return importlib.import_module(module).main
    except KeyboardInterrupt as e:
        sys.exit(interrupted_as_it_started(e))


def exit_after_main(code: int) -> NoReturn:
    """sys.exit(code) from a tool's script once its main() returned (the outcome said): Ctrl-C and SIGTERM ignored
    from then on (`ignore_interrupts_from_now`), there and not in main(), which tests call in-process."""
    ignore_interrupts_from_now()
    sys.exit(code)


@contextlib.contextmanager
def interrupts_unwrapped(on_interrupt: Callable[[], None] | None = None) -> Iterator[None]:
    """An interrupt of the block (Ctrl-C, or SIGTERM under `sigterm_as_interrupt`) reaches the caller as itself.

    For blocks that save or load with torch.distributed.checkpoint, which turns any exception of its planning and
    reading, a KeyboardInterrupt too, into a CheckpointException: the tools then printed a long traceback and exited
    1, not their one `error: interrupted` line and 130 / 143. It is raised as the interrupt again: the one our handler
    raised, or the one the exception holds (Python's own SIGINT handler, which records nothing here). Python runs a
    handler inside at-fork hooks, whose exceptions it only prints: the interrupt is raised when the block ends.
    Usable as a decorator. `on_interrupt` runs first when the block ends by an interrupt (cleanup that must not wait).
    """
    seen = len(_received)
    try:
        yield
    except BaseException as e:
        interrupt = _interrupt_within(e, seen)
        if interrupt is None:
            raise
        if on_interrupt is not None:
            on_interrupt()
        if interrupt is e:
            raise
        raise interrupt from e
    if len(_received) > seen:
        raise _interrupt_for(_received[-1])


def _interrupt_within(e: BaseException, seen: int) -> KeyboardInterrupt | None:
    """The interrupt that `e` is or stands for (None if none): `e` itself, the one our handler raised since
    `len(_received) == seen`, or `interrupt_behind(e)`."""
    if isinstance(e, KeyboardInterrupt):
        return e
    if len(_received) > seen:
        return _interrupt_for(_received[-1])
    return interrupt_behind(e)


def interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The interrupt (Ctrl-C, SIGTERM) that exception `e` wraps, None if none: one in the chain of its causes
    (`raise ... from`; Python 3.11's RuntimeError for an exception in a class's `__set_name__`), or one that
    torch.distributed.checkpoint's CheckpointException holds (its `failures`: rank -> (exception, traceback); not
    imported here, so that the tools import no torch for their --help)."""
    cause = e.__cause__
    while cause is not None:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        cause = cause.__cause__
    failures = getattr(e, "failures", None)
    for failure in failures.values() if isinstance(failures, dict) else ():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, KeyboardInterrupt):
            return inner
    return None


@contextlib.contextmanager
def children_killed_on_interrupt() -> Iterator[None]:
    """Child processes started in the block do not outlive an interrupt of it, and the interrupt is not lost.

    For a block that forks helpers and waits for them (Megatron-Core's checkpoint writers). On KeyboardInterrupt
    (Ctrl-C, or SIGTERM under `sigterm_as_interrupt`) the helpers are killed before it propagates: the caller's
    cleanup then does not race with them (removing the folder they write to), and the exit does not wait for
    them. An interrupt that torch.distributed.checkpoint wrapped, or that came inside an at-fork hook, is raised as
    itself (`interrupts_unwrapped`; after a hook's, the helpers ignore the signal and the block ends when their
    write is done).
    """
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    with interrupts_unwrapped(on_interrupt=lambda: _kill_children(me, before)):
        yield


def _kill_children(me, before: set[int]) -> None:
    """SIGKILL (forked helpers ignore SIGTERM and SIGINT) and reap `me`'s children that are not in `before`."""
    import multiprocessing

    import psutil

    new = [p for p in me.children() if p.pid not in before]
    for p in new:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    # multiprocessing reaps the ones it started (so their exitcode is right); psutil any it had not recorded yet
    tracked = {p.pid: p for p in multiprocessing.active_children()}
    for p in new:
        if p.pid in tracked:
            tracked[p.pid].join()
    psutil.wait_procs([p for p in new if p.pid not in tracked], timeout=30)
