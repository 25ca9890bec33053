"""Pins of megatron_ext.progress found by mutation audit round 7: a log bar's lines reach the file as they are
written, stay lines whatever the tool calls, stay plain ASCII, keep their pace when a run slows down; a terminal's
bar honours `enabled` and `mininterval`."""

from __future__ import annotations

import io

import pytest

from megatron_ext.progress import progress_bar


def test_each_log_line_reaches_the_file_at_once():
    """Under Slurm stderr is a file: a line held in its buffer until the run ends says nothing of its progress."""
    raw = io.BytesIO()
    log = io.TextIOWrapper(raw, encoding="utf-8")  # buffered, as a redirected stderr with its own buffer
    bar = progress_bar(total=4, desc="verify", unit="B", file=log)
    assert raw.getvalue().startswith(b"verify:   0%|"), raw.getvalue()
    bar.close()


def test_descriptions_and_postfix_strings_wait_for_the_next_line():
    """Any of tqdm's setters redraws at once by default: one line per call (per step) in a log."""
    out = io.StringIO()
    bar = progress_bar(total=4, desc="base", unit="step", file=out)
    for step in range(4):
        bar.update(1)
        bar.set_description(f"base {step}")
        bar.set_description_str(f"base {step}: ")
        bar.set_postfix_str(f"loss={step}.0")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "4/4" in lines[1] and "loss=3.0" in lines[1], lines


def test_log_lines_are_ascii():
    """Plain ASCII (`#` bars, no block characters): a log read with a C locale, grep and less shows them as is."""
    out = io.StringIO()
    with progress_bar(total=3, desc="cpt", unit="tok", file=out) as bar:
        bar.update(2)
    text = out.getvalue()
    assert text.isascii() and "#" in text, repr(text)


def test_a_run_that_slows_down_keeps_its_pace_of_lines(monkeypatch):
    """One line every LOG_PROGRESS_SECONDS of the clock, however the pace of updates changes: tqdm's own guess of
    how many updates to skip, learnt while the run was fast, silenced it when it slowed down. Time stood in for by
    a clock the test moves (no sleeping)."""
    import tqdm.std

    now = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 0)  # no monitor thread on the real clock
    out = io.StringIO()
    bar = progress_bar(total=1000, desc="ppl", unit="doc", file=out)
    for _ in range(300):  # fast: 0.1 s a document, a line every 30 s
        now[0] += 0.1
        bar.update(1)
    fast = len(out.getvalue().splitlines())
    for _ in range(10):  # slow: 40 s a document, so each update is due a line
        now[0] += 40.0
        bar.update(1)
    slow = len(out.getvalue().splitlines()) - fast
    bar.close()
    assert slow == 10, out.getvalue()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminals_bar_honours_enabled_and_mininterval():
    quiet = _Terminal()
    bar = progress_bar(range(3), desc="ppl", unit="doc", enabled=False, file=quiet)
    assert list(bar) == [0, 1, 2] and quiet.getvalue() == ""
    screen = _Terminal()
    bar = progress_bar(total=20, desc="niah", unit="cell", file=screen, mininterval=0)
    for _ in range(20):
        bar.update(1)
    # redrawn in place on every update, not once every LOG_PROGRESS_SECONDS
    assert screen.getvalue().count("\r") >= 20, repr(screen.getvalue())
    bar.close()


@pytest.fixture(autouse=True)
def _no_leftover_bars():
    yield
    import tqdm

    for bar in list(getattr(tqdm.tqdm, "_instances", [])):
        bar.close()


def test_unit_scale_reaches_a_log_bar():
    """`verify` counts bytes and `cpt` tokens with unit_scale: 3.00MB/3.00MB, not 3000000B/3000000B."""
    out = io.StringIO()
    with progress_bar(total=3_000_000, desc="verify", unit="B", unit_scale=True, file=out) as bar:
        bar.update(3_000_000)
    assert "3.00M/3.00M" in out.getvalue().splitlines()[-1], out.getvalue()


def test_transformers_bars_follow_stderr_where_they_draw(monkeypatch):
    """`tool 2> log` on a terminal: transformers draws on stderr, a file, so its bars are off though stdout is a
    terminal (and on when only stderr is one)."""
    import sys

    from transformers.utils import logging as hf_logging

    from megatron_ext.progress import quiet_library_bars

    try:
        hf_logging.enable_progress_bar()
        monkeypatch.setattr(sys, "stdout", _Terminal())
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        quiet_library_bars()
        assert not hf_logging.is_progress_bar_enabled()
        hf_logging.enable_progress_bar()
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        monkeypatch.setattr(sys, "stderr", _Terminal())
        quiet_library_bars()
        assert hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
