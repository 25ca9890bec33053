"""A write that failed for want of room: a full disk (ENOSPC), a quota (EDQUOT) or a file-size limit (EFBIG).

Recognised in an error (its errno, in its causes too, or in the text of an error that crossed a process boundary),
or by a small test write where the error hides its errno; said in one line with the space left there.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from megatron_ext.cli_types import nearest_existing

# what each errno means, in the words of an error line
SPACE_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (the file system's or the process's file-size limit, ulimit -f)",
}

PROBE_BYTES = 1 << 20

# a file-size limit is lifted, not made room for: free space is beside the point there
FILE_SIZE_FIX = "lift the file-size limit (ulimit -f) or use a file system that takes larger files"


def each_error(error: BaseException) -> Iterator[BaseException]:
    """`error`, its causes and contexts, and the per-rank errors a torch.distributed.checkpoint CheckpointException
    holds (`failures`: rank -> (exception, traceback)), each once."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]


def space_errno(error: BaseException) -> int | None:
    """The errno (one of SPACE_ERRNOS) of the first out-of-space OSError in `error` (see `each_error`), also of one
    known only by its text (`[Errno 28] ...`, as a checkpoint writer process passes it on); None when there is none."""
    for e in each_error(error):
        if isinstance(e, OSError) and e.errno in SPACE_ERRNOS:
            return e.errno
    for e in each_error(error):
        text = str(e)
        for number in SPACE_ERRNOS:
            if f"[Errno {number}]" in text or os.strerror(number) in text:
                return number
    return None


def free_bytes(path: str | Path) -> int | None:
    """Bytes free for this user on the file system of `path` (or of its nearest existing parent); None if unknown."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


def probe_write(folder: str | Path, size: int = PROBE_BYTES) -> OSError | None:
    """Write (and fsync) `size` bytes to a new file in `folder`, then remove it: the OSError the write raised, or
    None. For a writer whose error hid its errno (torch's zip writer: 'unexpected pos'): the failed write's files
    are still there, so a full disk or quota fails this one too, and says which."""
    probe = Path(folder) / f".space-probe-{uuid.uuid4().hex[:12]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return None


def size_text(n: int) -> str:
    """Bytes as people read them in a message: '3.4 MB', '12.0 GB'."""
    return f"{n / 1e9:.1f} GB" if n >= 10**10 else f"{n / 1e6:.1f} MB"


def free_text(path: str | Path) -> str:
    """'0.3 MB free there' for `path`'s file system, or '' when that cannot be read."""
    free = free_bytes(path)
    return "" if free is None else f"{size_text(free)} free there"


def no_space_message(error: BaseException, where: str, path: str | Path, outcome: str, fix: str) -> str | None:
    """One error line's text for an out-of-space `error` ('--output x: no space left on device (0.1 MB free there);
    OUTCOME; FIX'), or None when `error` is not one. `where` names the flag or field and its value, `path` is where
    the free space is read (after the unfinished output was removed: what the user has to work with)."""
    number = space_errno(error)
    if number is None:
        return None
    free, fix = (free_text(path), fix) if number != errno.EFBIG else ("", FILE_SIZE_FIX)
    return f"{where}: {SPACE_ERRNOS[number]}{f' ({free})' if free else ''}; {outcome}; {fix}"
