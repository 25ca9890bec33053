"""SIGTERM as Ctrl-C for the command-line tools (conversion, evaluation, quantisation).

Slurm's `scancel` and its time limit, and a plain `kill`, send SIGTERM, whose default action ends the
process at once: the cleanup that runs on Ctrl-C (removing a half-written output's temporary folder)
never runs, and a full-size hidden copy stays behind per attempt. The trainer has its own handler
(`megatron_ext.train.StopFlag`: finish the step, save, exit for requeue); this one is for the tools.
"""

from __future__ import annotations

import signal


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated(f"received signal {signal.Signals(signum).name}")


def sigterm_as_interrupt() -> None:
    """From now on SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread, so `finally` blocks
    and `except KeyboardInterrupt` cleanups run as on Ctrl-C. Call it at the start of a tool's `main`."""
    signal.signal(signal.SIGTERM, _raise_terminated)
