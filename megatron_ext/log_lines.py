"""The local-time prefix of the human-readable `[tag] ...` lines of the trainer and the evaluation tools.

A training or 1M-token evaluation job runs for hours to days under Slurm; a time on each line lets its log be read
against Slurm's, the GPUs' and the file system's events (Megatron-LM's own lines carry one too). Only those tagged
lines are stamped: `error: ...` / `warning: ...` lines, JSON, tables and progress bars are read by programs and
people as they were, and stay so.

Torch-free and cheap to import: the command-line tools answer `--help` without torch.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import TextIO

# Megatron-LM's form; local time (as `date` and Slurm's logs show it), no UTC offset.
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def stamped(msg: str) -> str:
    """`msg` after the local wall-clock time: `[2026-12-02 14:05:09] [niah] length 256: ...`.

    The time goes first and the tag keeps its place after it, so `grep "\\[niah\\]"` still finds the lines.
    """
    return f"[{datetime.now().strftime(LOG_TIME_FORMAT)}] {msg}"


def log_line(msg: str, file: TextIO | None = None) -> None:
    """Print `stamped(msg)` to `file` (default: stdout at the time of the call) and flush it.

    Flushed at once: under Slurm stdout is a file, and a line held in a buffer for an hour dates nothing. Written
    in one call, newline included: unbuffered (`python -u`, PYTHONUNBUFFERED) `print` writes a line and its newline
    apart, and another rank appending to the same file could land between them.
    """
    out = sys.stdout if file is None else file
    out.write(stamped(msg) + "\n")
    out.flush()
