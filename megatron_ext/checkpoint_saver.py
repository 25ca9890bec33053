"""The trainer's checkpoint saves, written at once or in the background (`checkpoint.async_save`).

A background save costs the step only the save's planning and the staging of the state in host memory
(a copy from the GPU); a forked process
writes the shards while training goes on, and the save is finalised (completeness check, rename into
`iter_N`, `latest` moved) at the first step boundary after every rank's writer is done. Until then the
previous checkpoint stays the latest, so a crash during the write loses nothing already saved.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

from megatron_ext.checkpoint import save_checkpoint
from megatron_ext.checkpoint_layout import iter_dir_name
from megatron_ext.checkpoint_space import CheckpointSpaceError


class CheckpointSaver:
    """Saves the training state into `root`; every method is collective (all ranks call it in step)."""

    def __init__(self, root: Path, *, keep_last: int | None, background: bool, log: Callable[[str], None],
                 optimizer_sharding: str = "dp_reshardable"):
        self.root, self.keep_last, self.log = Path(root), keep_last, log
        self.optimizer_sharding = optimizer_sharding
        self.queue = None
        if background:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()
        # iterations scheduled and not yet finalised, oldest first: (step, when it began, seconds the loop waited)
        self.writing: deque[tuple[int, float, float]] = deque()

    def save(self, step: int, model_chunks: list, *, optimizer, scheduler, metadata: dict, wait: bool) -> None:
        """Save iteration `step`; `wait=True` returns only once it (and any earlier one) is in place."""
        began = time.time()
        with self._in_recipe_words():
            save_checkpoint(self.root, step, model_chunks, optimizer=optimizer, scheduler=scheduler,
                            metadata=metadata, keep_last=self.keep_last, async_queue=self.queue,
                            optimizer_sharding=self.optimizer_sharding)
        if self.queue is None:
            self.log(f"[train] saved {self.root / iter_dir_name(step)} ({time.time() - began:.1f} s)")
            return
        self.writing.append((step, began, time.time() - began))
        if wait:
            self.finalize(blocking=True)

    def finalize(self, blocking: bool = False) -> None:
        """Put the background saves that every rank has finished in place (`blocking`: wait for all)."""
        if self.queue is None:
            return
        with self._in_recipe_words():
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        for _ in done:
            step, began, staged = self.writing.popleft()
            self.log(f"[train] saved {self.root / iter_dir_name(step)} (in the background: in place "
                     f"{time.time() - began:.1f} s after it began; the loop waited {staged:.1f} s)")

    @contextlib.contextmanager
    def _in_recipe_words(self) -> Iterator[None]:
        """A save that ran out of space, said as the trainer's user knows the folder: checkpoint.dir."""
        try:
            yield
        except CheckpointSpaceError as e:
            raise e.reworded(f"checkpoint.dir {self.root}", "free space or move checkpoint.dir") from None
