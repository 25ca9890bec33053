"""How a training run stops on a signal: every rank finishes the step, agrees, saves and exits (megatron_ext.train).

Slurm's warning before the time limit (SIGUSR1), a cancel (SIGTERM) and the batch shell's stop (SIGUSR2) end in a
save and the requeue exit; Ctrl-C in a save and exit 130. The flag is only read at the end of a step, so that a
signal never interrupts a collective or a half-made update.
"""

from __future__ import annotations

import signal
import time

import torch

from megatron_ext.runtime.distributed import rank_device
from megatron_ext.train_metrics import log


class StopFlag:
    """Set by SIGTERM / SIGUSR1 / SIGUSR2; every rank agrees on it at the end of a step. (USR2 is the batch shell's
    stop-without-requeue signal, slurm/common.sh; if a Slurm passes it on to the tasks, they save as for USR1.)

    Ctrl-C (SIGINT) in the training loop stops the same way, saved, but exits 130 (`train.EXIT_INTERRUPTED`, no
    requeue); before the loop, or again later than `SECOND_CTRL_C_S` after the first, it stops at once, unsaved
    (KeyboardInterrupt). torchrun passes a terminal's Ctrl-C on to its workers, which so get it twice within
    milliseconds."""

    SECOND_CTRL_C_S = 2.0

    def __init__(self) -> None:
        self.signal: int | None = None
        self.interrupted_at: float | None = None  # the first Ctrl-C in the loop
        self.in_loop = False  # set by the loop: only there is a step to finish and a state worth saving
        self.interrupted_anywhere = False  # after agreed(): a Ctrl-C on some rank
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            again = self.interrupted_at is not None and now - self.interrupted_at > self.SECOND_CTRL_C_S
            if not self.in_loop or again:
                raise KeyboardInterrupt
            if self.interrupted_at is None:
                self.interrupted_at = now
                log("[train] Ctrl-C: finishing this step and saving (Ctrl-C again to stop without saving)")
        self.signal = signum

    def agreed(self) -> bool:
        """Whether any rank was signalled (every rank calls it); sets `interrupted_anywhere`."""
        t = torch.tensor([2 if self.interrupted_at is not None else int(self.signal is not None)], dtype=torch.int32,
                         device=rank_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        self.interrupted_anywhere = t.item() == 2
        return bool(t.item())


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank calls it): so that all ranks take the same branch."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=rank_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())
