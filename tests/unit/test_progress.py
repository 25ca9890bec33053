"""Progress bars in log files: plain lines, not tqdm's '\\r' redraws.

stderr a file (a Slurm log): the evaluations, the converters, calibration and the demo drew tqdm bars whose
every update was a '\\r' redraw, so a whole run piled up on one line. Each tool below runs its loop with its bar
on, stderr captured (no terminal, as a log file), and must write a start line and an end line, no '\\r'.
Data preparation's own bars: test_data_cpt.py, test_data_sft.py.
"""

from __future__ import annotations

import copy
import io
import json
import re
from collections.abc import Iterator

import pytest
import torch

from megatron_ext import progress
from megatron_ext.progress import progress_bar
from tests.unit.test_convert_fixtures import make_hf_model
from tests.unit.test_evaluate import Recorder, _read_needle, make_model, make_tokenizer


def bar_lines(err: str, desc: str) -> list[str]:
    """The bar's lines in captured stderr ('ppl:  33%|###3      | 1/3 [...]'), after checking that none was
    redrawn in place. Only this bar's: transformers' save_pretrained draws one of its own ('Writing model
    shards'), which is not the tool's."""
    lines = err.split("\n")
    assert not any("\r" in ln for ln in lines if f"{desc}: " in ln), repr(err[-2000:])
    return [ln for ln in lines if re.match(rf"{re.escape(desc)}: +\d+%\|", ln)]


def assert_start_and_end(lines: list[str], total: int, err: str) -> None:
    """A line at the start (0 of `total`) and one at the end (all of it), and with the default interval nothing
    in between for these second-long runs."""
    assert len(lines) == 2, err
    assert "  0%|" in lines[0] and f" 0/{total} " in lines[0], err
    assert "100%|" in lines[-1] and f" {total}/{total} " in lines[-1], err


@pytest.fixture(scope="module")
def tiny_model() -> Iterator[torch.nn.Module]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared machine: one intra-op thread is several times faster
    yield make_model()
    torch.set_num_threads(before)


def test_log_bar_is_lines_with_start_and_end():
    """Manual update()/close() as ruler and niah use the bar; a set_postfix() every step (the demo's loss) made a
    line per step, as tqdm redraws at once on it."""
    out = io.StringIO()
    bar = progress_bar(total=5, desc="niah", unit="cell", file=out)
    for _ in range(5):
        bar.update(1)
        bar.set_postfix(loss="1.000")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2, repr(out.getvalue())
    assert lines[0].startswith("niah:   0%|") and " 0/5 " in lines[0], lines
    assert lines[1].startswith("niah: 100%|") and " 5/5 " in lines[1] and "loss=1.000" in lines[1], lines


def test_log_bar_writes_every_interval_and_nothing_when_disabled(monkeypatch):
    monkeypatch.setattr(progress, "LOG_PROGRESS_SECONDS", 0.0)
    out = io.StringIO()
    assert list(progress_bar(range(3), desc="ppl", unit="doc", file=out)) == [0, 1, 2]
    # 0/3, after each document, and the close's own 3/3
    assert [ln.split("|")[2].split()[0] for ln in out.getvalue().splitlines()] == ["0/3", "1/3", "2/3", "3/3", "3/3"]
    quiet = io.StringIO()
    bar = progress_bar(range(3), desc="ppl", unit="doc", enabled=False, file=quiet)
    assert list(bar) == [0, 1, 2] and quiet.getvalue() == ""
    bar.update(1)  # a disabled bar still takes the calls of an enabled one
    bar.close()


def test_perplexity_in_a_log(tiny_model, capsys):
    from megatron_ext.evaluate import perplexity_by_position

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(5, 500, (40,), generator=g) for _ in range(3)]
    perplexity_by_position(tiny_model, docs, chunk=None, progress=True)
    err = capsys.readouterr().err
    assert_start_and_end(bar_lines(err, "ppl"), 3, err)


def test_niah_in_a_log(capsys):
    from megatron_ext.evaluate import run_niah

    tok = make_tokenizer()
    run_niah(None, tok, [80, 150], [0, 50], samples=2, generate=Recorder(tok, _read_needle), progress=True, log=None)
    err = capsys.readouterr().err
    assert_start_and_end(bar_lines(err, "niah"), 8, err)


def test_calibration_in_a_log(tiny_model, capsys):
    from megatron_ext.quantize.fp8 import calibrate_forward

    windows = [torch.randint(5, 500, (32,)) for _ in range(3)]
    calibrate_forward(windows, progress=True)(tiny_model)
    err = capsys.readouterr().err
    assert_start_and_end(bar_lines(err, "calibrate"), 3, err)


def test_converters_in_a_log(tmp_path, cpu_parallel_state, capsys):
    from megatron_ext.convert import to_hf, to_megatron

    src = make_hf_model(tmp_path / "hf")
    layers = 2  # the fixture's model: TINY
    to_megatron(src, tmp_path / "mcore", progress=True)
    err = capsys.readouterr().err
    lines = bar_lines(err, "hf -> megatron")
    assert len(lines) == 2 and "  0%|" in lines[0] and "100%|" in lines[-1], err
    to_hf(tmp_path / "mcore", tmp_path / "back", progress=True)
    err = capsys.readouterr().err
    assert_start_and_end(bar_lines(err, "megatron -> hf"), layers + 2, err)  # embedding, each layer, the head


def test_demo_base_training_in_a_log(tmp_path, toy_tokenizer, capsys):
    """The demo sets its loss on the bar every step: still a start and an end line, the end one with the loss."""
    from megatron_ext.demo.base import train_base

    train_base(tmp_path / "base", toy_tokenizer, steps=4, batch_size=2, seq_length=32, max_sentences=3, log=print)
    err = capsys.readouterr().err
    lines = bar_lines(err, "base")
    assert_start_and_end(lines, 4, err)
    assert "loss=" in lines[-1], err
    # the folder states its rope in the transformers-4 form (4.56-4.57 ignore `rope_parameters` alone), which
    # transformers reads back into the model's own rope
    from transformers import LlamaConfig

    from megatron_ext.presets import TINY_DEMO

    saved = json.loads((tmp_path / "base/config.json").read_text())
    assert "rope_parameters" not in saved and saved["rope_scaling"] == TINY_DEMO["rope_scaling"]  # preset unchanged
    assert LlamaConfig.from_pretrained(str(tmp_path / "base")).rope_parameters == \
        LlamaConfig(**copy.deepcopy({**TINY_DEMO, "max_position_embeddings": 32})).rope_parameters


def test_transformers_bars_are_off_in_a_log_and_kept_on_a_terminal():
    """transformers' "Loading weights" bar redrew with '\\r' in every evaluation, --verify and calibration log."""
    from transformers.utils import logging as hf_logging

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    try:
        hf_logging.enable_progress_bar()
        progress.quiet_library_bars(Terminal())  # control: a terminal keeps them
        assert hf_logging.is_progress_bar_enabled()
        progress.quiet_library_bars(io.StringIO())
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
