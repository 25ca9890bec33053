"""Pins of megatron_ext.log_lines found by mutation audit round 7: the stamp is the local time (as `date` and
Slurm's logs show it) also where the machine is not on UTC, and a line reaches its file as it is printed."""

from __future__ import annotations

import io
import os
import time
from datetime import datetime, timedelta

from megatron_ext.log_lines import LOG_TIME_FORMAT, log_line, stamped


def test_the_stamp_is_local_time_off_utc():
    """A machine 5 h 30 min off UTC: the stamp is what its clock shows, not UTC (which the other tests cannot tell
    apart on a machine on UTC). The oracle is the C library's local time (time.localtime)."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "XST-05:30"  # POSIX form: 5 h 30 min east of UTC, no daylight saving
    time.tzset()
    try:
        local = datetime.strptime(time.strftime(LOG_TIME_FORMAT, time.localtime()), LOG_TIME_FORMAT)
        when = datetime.strptime(stamped("[niah] x")[1:20], LOG_TIME_FORMAT)
        assert abs(when - local) < timedelta(seconds=2), (when, local)
    finally:
        if saved is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = saved
        time.tzset()


def test_a_line_reaches_a_buffered_file_at_once():
    """Under Slurm stdout is a file: a line held in the buffer for an hour dates nothing."""
    raw = io.BytesIO()
    log = io.TextIOWrapper(raw, encoding="utf-8")
    log_line("[train] step 1", log)
    assert raw.getvalue().decode().endswith("] [train] step 1\n"), raw.getvalue()


def test_the_message_keeps_its_own_spaces():
    """Aligned and indented lines (a table row under its tag) keep every space: only the stamp is added."""
    msg = "  [niah]   length        80: accuracy 1.00  "
    assert stamped(msg)[22:] == msg and stamped(msg)[20:22] == "] "


class _Writes(io.RawIOBase):
    """An unbuffered file that keeps each write apart, as each reaches a file shared by several ranks."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.writes.append(bytes(b))
        return len(b)


def test_a_line_is_one_write_under_python_u():
    """`python -u` (as the tests' ranks run, PYTHONUNBUFFERED as some clusters set): print writes the text and
    its newline apart, and two ranks appending to one stdout interleaved 'rank 1 ...Falserank 0 ...' in CI.
    log_line hands the whole line, newline included, to one write."""
    raw = _Writes()
    log_line("[train] step 1", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    assert len(raw.writes) == 1 and raw.writes[0].endswith(b"] [train] step 1\n"), raw.writes
