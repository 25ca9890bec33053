"""A checkpoint save that ran out of room (full disk, quota, file-size limit), said in one line.

Megatron-Core's writers are forked processes that write each shard with `torch.save`, whose zip writer turns the
OSError of a short write into `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`
(the OSError is only its `__context__`, and the exception crosses a process queue without it): a full disk reached
the user as tracebacks from every rank that never said "no space". The save's files are still in its temporary
folder when the failure surfaces, so a 1 MB test write there fails the same way and gives the errno back.
"""

from __future__ import annotations

import errno
import functools
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from megatron_ext.checkpoint_index import CheckpointError
from megatron_ext.checkpoint_layout import iter_dir_name, latest_iteration
from megatron_ext.disk_space import (FILE_SIZE_FIX, PROBE_BYTES, SPACE_ERRNOS, each_error, free_bytes, probe_write,
                                    size_text, space_errno)


class CheckpointSpaceError(CheckpointError):
    """A save of `iteration` into `root` that failed for want of space; `say` words it for a tool's flag or field."""

    def __init__(self, root: Path, iteration: int, verdict: dict[str, Any], need_bytes: int | None):
        self.root, self.iteration, self.verdict, self.need_bytes = Path(root), iteration, verdict, need_bytes
        super().__init__(self.say(f"checkpoint folder {root}", "free space there or save elsewhere"))

    def say(self, where: str, fix: str, outcome: str | None = None) -> str:
        """'WHERE: no space left on device while saving iteration 2 (0.9 MB free there now, ...); OUTCOME; FIX'.
        `outcome` (default: what the checkpoint folder holds now) replaces what the user is told is left."""
        v = self.verdict
        size_limit = v["errno"] == errno.EFBIG
        fix = FILE_SIZE_FIX if size_limit else fix
        notes = [f"{size_text(v['free'])} free there now" if v.get("free") is not None and not size_limit else None,
                 f"the save needs at least {size_text(self.need_bytes)}" if self.need_bytes else None,
                 v.get("basis")]
        detail = "; ".join(n for n in notes if n)
        return (f"{where}: {v['reason']} while {v.get('doing') or f'saving iteration {self.iteration}'}"
                f"{f' ({detail})' if detail else ''}; {outcome or self._outcome()}; {fix}")

    def _outcome(self) -> str:
        latest = self.verdict.get("latest")
        if self.verdict.get("published"):  # the folder is in place, the pointer is not
            return (f"{iter_dir_name(self.iteration)} is complete but the latest is still "
                    f"{'none' if latest is None else f'iteration {latest}'}")
        if latest is None:
            return "nothing was published (there is no earlier checkpoint there)"
        return f"nothing was published: the latest checkpoint is still iteration {latest} ({iter_dir_name(latest)})"

    def reworded(self, where: str, fix: str) -> CheckpointError:
        """The same failure as a CheckpointError in a tool's words (its flag or recipe field), marked alike on every
        rank where this one is."""
        from megatron_ext.runtime.distributed import alike_on_every_rank, is_alike_on_every_rank

        error = CheckpointError(self.say(where, fix))
        return alike_on_every_rank(error) if is_alike_on_every_rank(self) else error


def space_checked(fn: Callable, *, root: Path, iteration: int, tmp: Path, need: int) -> Callable:
    """`fn`, a step of a save that every rank runs and that raises a failed write on every rank (Megatron-Core's
    save and its finalisation: torch's CheckpointException), raising a failure for want of space as one
    CheckpointSpaceError alike on every rank (rank 0 judges it: `space_verdict`); other failures as they were."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_ext.runtime.distributed import alike_on_every_rank, rank_zero_outcome

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CheckpointException as e:
            verdict = rank_zero_outcome(functools.partial(space_verdict, e, root, tmp), CheckpointError)[0]
            if verdict is None:
                raise
            raise alike_on_every_rank(CheckpointSpaceError(root, iteration, verdict, need)) from None

    return run


def space_verdict(error: BaseException | None, root: Path, tmp: Path | None, doing: str | None = None,
                  published: bool = False) -> dict[str, Any] | None:
    """On rank 0, after a save failed with `error`: a dict saying it ran out of space (errno, reason, the basis where
    it was judged by a test write, free space, the latest iteration), or None when it did not. `tmp`, the save's
    temporary folder, is removed once the verdict is in (its space back; nothing loads it). `doing` replaces
    'saving iteration N' in the message; `published`: the iteration folder was already in place."""
    number, basis = (space_errno(error) if error is not None else None), None
    if number is None and error is not None:
        # torch's zip writer hides the errno (the module docstring): the shards written so far still take the
        # space, so a small write where they went fails the same way on a full disk or quota
        probe = probe_write(tmp if tmp is not None and tmp.is_dir() else root)
        if probe is not None and probe.errno in SPACE_ERRNOS:
            number = probe.errno
            basis = (f"judged by a {size_text(PROBE_BYTES)} test write there: torch's shard writer said only "
                     f"'{_writer_said(error)}'")
    if number is None:
        return None
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        latest = latest_iteration(root)
    except (CheckpointError, OSError):
        latest = None
    return {"errno": number, "reason": SPACE_ERRNOS[number], "basis": basis, "free": free_bytes(root),
            "latest": latest, "doing": doing, "published": published}


def _writer_said(error: BaseException) -> str:
    """What torch's zip writer said ('unexpected pos 704 vs 598'), else the error's first line."""
    for e in each_error(error):
        if found := re.search(r"unexpected pos \d+ vs \d+", str(e)):
            return found[0]
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:100]


def local_bytes(state: dict) -> int:
    """Bytes of the tensors in a sharded state dict that this rank holds: all of them are saved by some rank, so the
    whole save needs at least this much."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    total = 0
    for value in nested_values(state):
        data = getattr(value, "data", value)
        if isinstance(data, torch.Tensor):
            total += data.numel() * data.element_size()
    return total
