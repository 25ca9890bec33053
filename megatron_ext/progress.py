"""Progress bars of the long-running tools: data preparation, conversion, calibration, evaluation, the demo.

On a terminal a bar is tqdm's own, redrawn in place with '\\r'. A log file (a Slurm job's, a pipe into tee)
redraws nothing: every update of a run piled up on one line (~100 KB for 40 minutes of CPT) that neither `less`
nor `grep` could use. So anywhere but a terminal a bar writes plain lines instead: one at the start, one every
LOG_PROGRESS_SECONDS and one at the end.

tqdm is imported on the first bar, not with this module: the command-line tools answer `--help` without it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import Any, TextIO

# Seconds between two progress lines when stderr is no terminal (a Slurm log, a pipe): a run's pace shows within
# a minute, and a day-long one writes ~2,900 lines.
LOG_PROGRESS_SECONDS = 30.0


class _LineWriter:
    """A file for tqdm in which every redraw is a line of its own.

    tqdm redraws a bar in place: '\\r' + bar, padded with spaces over a longer previous one. In a log file nothing
    is redrawn: all updates of a run piled up on one line.
    """

    def __init__(self, file: TextIO):
        self.file = file

    def write(self, s: str) -> None:
        s = s.strip("\r\n ")  # close()'s extra '\n' and its probe write('') are no lines
        if s:
            self.file.write(s + "\n")
            self.file.flush()

    def flush(self) -> None:
        self.file.flush()


@functools.cache
def _log_bar_class() -> type:
    """tqdm whose new postfix or description waits for the next timed line.

    tqdm redraws at once on `set_postfix(...)` (the demo sets its loss every step): harmless in place on a
    terminal, a line per step in a log.
    """
    from tqdm import tqdm

    class LogBar(tqdm):
        def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
            super().set_postfix(ordered_dict, refresh=False, **kwargs)

        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            super().set_postfix_str(s, refresh=False)

        def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
            super().set_description(desc, refresh=False)

        def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
            super().set_description_str(desc, refresh=False)

    return LogBar


def progress_bar(iterable: Iterable | None = None, *, desc: str, unit: str, total: float | None = None,
                 unit_scale: bool = False, enabled: bool = True, file: TextIO | None = None,
                 mininterval: float = 0.1) -> Any:
    """A tqdm progress bar on `file` (default: stderr), silent unless `enabled` (tqdm's `disable=not enabled`).

    Used as tqdm is: iterated over, or `update(n)` / `set_postfix(...)` / `close()`, or as a context manager.
    On a terminal it is tqdm's bar, redrawn in place at most every `mininterval` seconds. Anywhere else it writes a
    plain line at the start, every LOG_PROGRESS_SECONDS and at the end: done so far, time elapsed, rate, and with a
    `total` (or an iterable with a length) the percentage and the time left.
    """
    file = sys.stderr if file is None else file
    if getattr(file, "isatty", None) and file.isatty():
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, unit=unit, unit_scale=unit_scale, total=total, disable=not enabled,
                    file=file, mininterval=mininterval)
    # miniters=1: look at the clock on every update, so no line waits for tqdm's count-based guess (a run that
    # slows down would print less and less often)
    return _log_bar_class()(iterable, desc=desc, unit=unit, unit_scale=unit_scale, total=total,
                            disable=not enabled, file=_LineWriter(file), mininterval=LOG_PROGRESS_SECONDS,
                            miniters=1, ascii=True)


def quiet_library_bars(file: TextIO | None = None) -> None:
    """Turn off transformers' own bars ("Loading weights", "Writing model shards") when `file` (default: stderr) is
    no terminal: they redraw with '\\r', so a log file got one long line per model load. Process-wide; on a
    terminal they stay."""
    file = sys.stderr if file is None else file
    if getattr(file, "isatty", None) and file.isatty():
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_progress_bar()
