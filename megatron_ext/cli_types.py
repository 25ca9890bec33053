"""What the command-line tools share about their arguments: argparse types (a mistake is argparse's one-line usage
error, naming the flag), and whether an output folder can be written, asked before the work."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Callable

WRITE_PROBE_PREFIX = ".write-test-"  # `folder_write_problem`'s folder, there for a moment: a folder holding it is empty


def nearest_existing(path: str | Path) -> Path:
    """`path` made absolute, or its nearest parent that exists: where a folder not made yet would be made."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def folder_write_problem(folder: str | Path) -> str | None:
    """Why no folder can be made and written at `folder`, as the end of a one-line error ("cannot create a folder
    there (No such file or directory in /proc); choose a writable path"), or None when one can.

    For a command's output, checked before its work (the write failed after it, as a traceback). Tried with a
    hidden folder, removed at once, in the nearest folder on the way that exists: nothing is left, the folders not
    there yet are not made. os.access cannot tell: it says yes to root everywhere, /proc and read-only mounts too.
    Every process of a job may call it at once (each its own probe).
    """
    base = nearest_existing(folder)
    if not base.is_dir():
        return f"{base} is a file, not a directory; choose a writable path"
    try:
        os.rmdir(tempfile.mkdtemp(dir=base, prefix=WRITE_PROBE_PREFIX))
    except OSError as e:
        return f"cannot create a folder there ({e.strerror or e} in {base}); choose a writable path"
    return None


def whole_number(minimum: int, meaning: str = "") -> Callable[[str], int]:
    """An argparse `type`: an integer >= `minimum` (0 was dropped unseen, -1 printed as iter_-000001); `meaning`
    says what the value is in the message (e.g. "an iteration is a step number")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: {meaning + ' ' if meaning else 'must be '}>= {minimum}")
        return value

    return parse
