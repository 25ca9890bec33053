"""SIGTERM as Ctrl-C for the command-line tools (conversion, evaluation, quantisation).

Slurm's `scancel` and its time limit, and a plain `kill`, send SIGTERM, whose default action ends the
process at once: the cleanup that runs on Ctrl-C (removing a half-written output's temporary folder)
never runs, and a full-size hidden copy stays behind per attempt. The trainer has its own handler
(`megatron_ext.train.StopFlag`: finish the step, save, exit for requeue); this one is for the tools.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated(f"received signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread, so `finally` blocks
    and `except KeyboardInterrupt` cleanups run as on Ctrl-C. A handler someone else installed stays (submitit's,
    when the launcher runs a tool in-process), and the previous disposition comes back after the block (tests
    call the tools' `main` in-process). Off the main thread nothing changes (Python delivers signals there only).
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
