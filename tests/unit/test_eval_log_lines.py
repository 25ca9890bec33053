"""tools/niah.py's human-readable `[niah]` / `[ruler]` / `[ppl]` / `[generate]` lines start with the local time, as
the trainer's `[train]` lines do (a 1M-token evaluation runs for hours under Slurm: its log is read against the
cluster's events). What programs and people read as it was stays so: `error: ...` and `warning: ...` lines at the
start of their line, the ruler.md table, the generated answer, and JSON on stdout (the converter's report)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from megatron_ext import log_lines
from megatron_ext.evaluate.cli import main
from megatron_ext.log_lines import LOG_TIME_FORMAT, stamped
from tests.unit.test_evaluate import Recorder, _read_needle, make_tokenizer, save_tiny

STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] (.*)")
TAG = re.compile(r"\[(niah|ruler|ppl|generate)\] ")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models on a shared machine: one intra-op thread is faster (no spinning), as in test_evaluate."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny HF model and tokenizer of test_evaluate, saved once for this module."""
    return save_tiny(tmp_path_factory.mktemp("tiny_hf"))


def split_stamped(line: str) -> tuple[datetime, str]:
    """(the time, the message) of a stamped line; fails when the line does not start with a time."""
    m = STAMP.fullmatch(line)
    assert m, f"no time at the start of {line!r}"
    return datetime.strptime(m[1], LOG_TIME_FORMAT), m[2]


def tagged_messages(text: str, started: datetime) -> list[str]:
    """The messages of the lines of `text` that carry an evaluation tag, after checking each starts with a time
    taken since `started` and the tag follows it."""
    messages = []
    for line in text.splitlines():
        if not TAG.search(line):
            continue
        when, msg = split_stamped(line)
        assert started <= when <= datetime.now(), line
        assert TAG.match(msg), line  # the tag right after the time: `grep "\[niah\]"` and `[niah] ` splits work
        messages.append(msg)
    return messages


def now() -> datetime:
    return datetime.now().replace(microsecond=0)  # the stamp has whole seconds


def test_stamped_is_the_trainers_form():
    """One format for the trainer and the evaluation: Megatron-LM's `[YYYY-MM-DD HH:MM:SS] `, local time."""
    assert LOG_TIME_FORMAT == "%Y-%m-%d %H:%M:%S"
    before = now()
    line = stamped("[niah] length 256: accuracy 0.00")
    when, msg = split_stamped(line)
    assert before <= when <= datetime.now() and msg == "[niah] length 256: accuracy 0.00"
    assert line[0] == "[" and line[20:22] == "] "


def test_log_line_prints_to_the_stream_of_the_call(capsys):
    log_lines.log_line("[generate] wrote x")
    log_lines.log_line("[niah] converting y", sys.stderr)
    text = capsys.readouterr()
    assert split_stamped(text.out.rstrip("\n"))[1] == "[generate] wrote x"
    assert split_stamped(text.err.rstrip("\n"))[1] == "[niah] converting y"


def test_niah_lines_per_length_carry_the_time(capsys):
    """run_niah's default log (what tools/niah.py and each length of a 1M sweep print)."""
    from megatron_ext.evaluate import run_niah

    tok = make_tokenizer()
    started = now()
    run_niah(None, tok, [80, 150], [0, 50], generate=Recorder(tok, _read_needle), progress=False)
    out = capsys.readouterr().out
    messages = tagged_messages(out, started)
    assert len(messages) == 2 == len(out.splitlines()), out
    assert messages[0].startswith("[niah] length        80: accuracy 1.00 over 2 prompts (2 run, "), messages
    assert messages[1].startswith("[niah] length       150: accuracy 1.00 over 2 prompts (2 run, "), messages


def test_cli_lines_carry_the_time_and_errors_warnings_stay_bare(tiny_dir, tmp_path, capsys):
    """tools/niah.py on a tiny model: every tagged line (memory note, per length, accuracy) is stamped; the warning
    of a skipped length and a mistake's `error: ` line are not."""
    started = now()
    assert main(["--model", str(tiny_dir), "--lengths", "64,512", "--depths", "0,100", "--out", str(tmp_path / "n"),
                 "--max-new-tokens", "2", "--no-progress"]) == 0
    text = capsys.readouterr()
    messages = tagged_messages(text.out, started)
    assert len(messages) == len(text.out.splitlines()) == 3, text.out  # nothing on stdout without a time
    assert messages[0].startswith("[niah] memory note: ") and messages[1].startswith("[niah] length        64: ")
    assert messages[2].startswith("[niah] accuracy ") and str(tmp_path / "n" / "results.json") in messages[2]
    assert text.err.startswith("warning: lengths [512] exceed"), text.err

    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_dir), "--depths", "0,200", "--out", str(tmp_path / "o")])
    assert e.value.code.startswith("error: --depths: [200.0] are outside 0..100"), e.value.code


def test_ppl_and_generate_lines_carry_the_time_and_the_answer_stays_bare(tiny_dir, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("The old river passes the garden near the hill. " * 10)
    started = now()
    assert main(["ppl", "--model", str(tiny_dir), "--text", str(doc), "--out", str(tmp_path / "ppl"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    messages = tagged_messages(out, started)
    assert len(messages) == len(out.splitlines()) == 2, out
    assert messages[0].startswith("[ppl] memory note: ") and messages[1].startswith("[ppl] 1 documents, ")

    assert main(["generate", "--model", str(tiny_dir), "--document", str(doc), "--question", "Where is the river?",
                 "--max-new-tokens", "3", "--out", str(tmp_path / "g"), "--no-progress"]) == 0
    text = capsys.readouterr()
    answer = json.loads((tmp_path / "g" / "generation.json").read_text())["output"]
    assert text.out == answer + "\n"  # the command's output: the answer alone, as generated
    messages = tagged_messages(text.err, started)
    assert len(messages) == 2 and "prompt tokens -> 3 new tokens" in messages[0], text.err
    assert messages[1] == f"[generate] wrote {tmp_path / 'g' / 'generation.json'}"


def test_ruler_lines_carry_the_time_and_the_table_stays_bare(tiny_dir, tmp_path, capsys):
    """The ruler.md table printed to stdout keeps its rows (`|` first): a stamp would break the Markdown."""
    started = now()
    out_dir = tmp_path / "r"
    assert main(["ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1,vt", "--lengths", "200",
                 "--samples", "1", "--max-new-tokens", "2", "--out", str(out_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    messages = tagged_messages(out, started)
    assert messages[0].startswith("[ruler] memory note: ")
    assert [m.split()[1] for m in messages[1:3]] == ["niah_single_1", "vt"], messages
    assert messages[-1].startswith("[ruler] average ") and len(messages) == 4, messages
    table = (out_dir / "ruler.md").read_text().split("\n\n", 2)[2].rstrip("\n")
    assert table in out and all(row.startswith("|") for row in table.splitlines()), out


def test_the_converters_json_report_stays_bare(tmp_path, cpu_parallel_state, capsys):
    """JSON on stdout is read by programs: the converter's report is one JSON line, no time before it."""
    from megatron_ext import convert_cli

    hf = save_tiny(tmp_path / "hf")
    assert convert_cli.main(["to-megatron", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("{") and out.count("\n") == 1, out
    assert isinstance(json.loads(out), dict)


def test_nothing_in_a_stamped_line_is_lost():
    """The message is kept whole, brackets and all, and the time is the time of the call."""
    msg = "[niah] length 1,048,576: accuracy 0.90 over 10 prompts (10 run, 3h02m) [x] y"
    when, kept = split_stamped(stamped(msg))
    assert kept == msg and abs(datetime.now() - when) < timedelta(seconds=2)
