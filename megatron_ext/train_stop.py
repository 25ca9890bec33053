"""How a training run stops on a signal: every rank finishes the step, agrees, saves and exits (megatron_ext.train).

Slurm's warning before the time limit (SIGUSR1), a cancel (SIGTERM) and the batch shell's stop (SIGUSR2) end in a
save and the requeue exit; Ctrl-C in a save and exit 130. The flag is only read at the end of a step, so that a
signal never interrupts a collective or a half-made update. Before the loop Ctrl-C stops at once, nothing saved, in
one line (`catch_signals_while_starting` covers the imports, before `StopFlag` exists); once the outcome is said
(`StopFlag.settle`) signals change nothing.

Torch is imported where it is used: `python -m megatron_ext.train` imports this module before torch.
"""

from __future__ import annotations

import os
import signal
import sys
import time

EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it: a stop the user asked for, not requeued
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
_kept: list[int] = []  # stop signals that came while starting, before StopFlag: it acts on them


def catch_signals_while_starting() -> None:
    """For `python -m megatron_ext.train`, called before it imports torch and Megatron-Core (seconds; longer on a
    cold file system): Ctrl-C then ends the process with one line and exit 130, where a KeyboardInterrupt raised
    inside an import was a traceback; SIGTERM / SIGUSR1 / SIGUSR2, whose default action ended it without a word or
    a requeue, are kept for `StopFlag`, which handles them as any that come before the loop."""
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: _kept.append(signum))


def _interrupted_while_starting(signum, frame) -> None:
    say_stopped_unsaved(in_loop=False)
    # not SystemExit: raised inside an import it could meet a `__del__` or a library's `except BaseException`, which
    # print or swallow it; nothing is open or written yet
    os._exit(EXIT_INTERRUPTED)


def say_stopped_unsaved(in_loop: bool) -> None:
    """The one line of a Ctrl-C that stops the run unsaved: before the first step, or a second one in the loop. On
    stderr, as the tools' `error: interrupted` lines (the run ends without its outcome); on the first rank, by the
    launcher's variables (the process group may not be made yet, or be gone)."""
    from megatron_ext.log_lines import log_line

    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return
    if in_loop:
        log_line("[train] interrupted (Ctrl-C): stopped without saving; the newest checkpoint in checkpoint.dir is "
                 "where the same command goes on from", file=sys.stderr)
    else:
        log_line("[train] interrupted (Ctrl-C) before the first step: nothing trained or saved; the same command "
                 "starts again (from the newest checkpoint in checkpoint.dir, if there is one)", file=sys.stderr)


class StopFlag:
    """Set by SIGTERM / SIGUSR1 / SIGUSR2; every rank agrees on it at the end of a step. (USR2 is the batch shell's
    stop-without-requeue signal, slurm/common.sh; if a Slurm passes it on to the tasks, they save as for USR1.)

    Ctrl-C (SIGINT) in the training loop stops the same way, saved, but exits 130 (`train.EXIT_INTERRUPTED`, no
    requeue); before the loop, or again later than `SECOND_CTRL_C_S` after the first, it stops at once, unsaved
    (KeyboardInterrupt). torchrun passes a terminal's Ctrl-C on to its workers, which so get it twice within
    milliseconds."""

    SECOND_CTRL_C_S = 2.0

    def __init__(self) -> None:
        self.signal: int | None = _kept[-1] if _kept else None  # one that came during the imports
        self.interrupted_at: float | None = None  # the first Ctrl-C in the loop
        self.in_loop = False  # set by the loop: only there is a step to finish and a state worth saving
        self.interrupted_anywhere = False  # after agreed(): a Ctrl-C on some rank
        for sig in (*_STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, self._handle)

    def settle(self) -> None:
        """The run's outcome is decided and is said next (done, saved and stopping, diverged, an error): signals are
        ignored from now on, so that neither the exit status nor the log changes after that line. A Ctrl-C after
        `done` printed 'finishing this step and saving'; one in the teardown after it (the process group, Python's
        own exit, which restores a handled signal's default action) ended a complete run with status -2 (130) and
        no word; a SIGTERM there turned the requeue exit 3 into -15. Kept for the rest of the process: the
        teardown is short, and a launcher that runs `main` in-process (submitit) only records the result."""
        for sig in (*_STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            again = self.interrupted_at is not None and now - self.interrupted_at > self.SECOND_CTRL_C_S
            if not self.in_loop or again:
                raise KeyboardInterrupt
            if self.interrupted_at is None:
                from megatron_ext.train_metrics import log

                self.interrupted_at = now
                log("[train] Ctrl-C: finishing this step and saving (Ctrl-C again to stop without saving)")
        self.signal = signum

    def agreed(self) -> bool:
        """Whether any rank was signalled (every rank calls it); sets `interrupted_anywhere`."""
        import torch

        from megatron_ext.runtime.distributed import rank_device

        t = torch.tensor([2 if self.interrupted_at is not None else int(self.signal is not None)], dtype=torch.int32,
                         device=rank_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        self.interrupted_anywhere = t.item() == 2
        return bool(t.item())


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank calls it): so that all ranks take the same branch."""
    import torch

    from megatron_ext.runtime.distributed import rank_device

    t = torch.tensor([int(flag)], dtype=torch.int32, device=rank_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())
