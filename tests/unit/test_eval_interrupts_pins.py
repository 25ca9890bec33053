"""Pins of megatron_ext.evaluate.interrupts found by mutation audit round 7: the one line an interrupted
tools/niah.py run prints says what it kept, decided from the files on disk and the command's own arguments
(parsed by the real parsers). The end-to-end runs are in test_eval_interrupts.py."""

from __future__ import annotations

import os
import time

import pytest

from megatron_ext.evaluate.cli_args import parsers
from megatron_ext.evaluate.interrupts import interrupted
from megatron_ext.runtime.signals import Terminated

COPY_REMOVED = "the Hugging Face copy of --megatron was removed"


def _said(command: str, argv: list[str], started: float, capsys, e: KeyboardInterrupt = None) -> str:
    args = parsers()[command].parse_args(argv)
    status = interrupted(command, args, started, Terminated() if e is None else e)
    assert status == (143 if e is None else 130)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: interrupted ("), err
    return err.rstrip("\n")


@pytest.mark.parametrize("source, removed", [
    (["--model", "M"], False),
    (["--megatron", "M"], True),  # the hf engine (the default) converted it into a hidden folder of --out
    (["--megatron", "M", "--engine", "megatron"], False),  # ran as is: no copy was made
])
def test_the_removed_copy_is_named_only_when_one_was_made(source, removed, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    line = _said("ppl", [*source, "--text", "T", "--out", str(tmp_path / "o")], time.time(), capsys)
    assert (COPY_REMOVED in line) == removed, line


def _results(out, name: str, age: float) -> None:
    out.mkdir(exist_ok=True)
    path = out / name
    path.write_text("{}")
    when = time.time() - age
    os.utime(path, (when, when))


@pytest.mark.parametrize("command, name", [("niah", "results.json"), ("ruler", "ruler.json")])
def test_the_grid_saved_by_this_run_is_named_with_resume(command, name, tmp_path, capsys, monkeypatch):
    """The file each sweep saves after every length: written in this run (a file system that keeps whole seconds
    may date it up to a second before the start), it is what --resume goes on from."""
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "o"
    started = time.time()
    _results(out, name, age=0.5)
    extra = ["--tasks", "niah_single_1"] if command == "ruler" else []
    line = _said(command, ["--model", "M", "--out", str(out), *extra], started, capsys)
    assert line == (f"error: interrupted (SIGTERM); the results so far are saved in {out / name} (after every "
                    "length): run the same command with --resume to go on")


@pytest.mark.parametrize("command, other", [("niah", "ruler.json"), ("ruler", "results.json")])
def test_an_earlier_runs_grid_or_the_other_commands_is_not_this_runs(command, other, tmp_path, capsys, monkeypatch):
    """An old grid (a run before this one, no --resume: it starts over) and the other sweep's file saved nothing
    of this run; with --resume the old grid is this run's starting point, kept."""
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "o"
    name = {"niah": "results.json", "ruler": "ruler.json"}[command]
    _results(out, name, age=3600)
    _results(out, other, age=0)
    extra = ["--tasks", "niah_single_1"] if command == "ruler" else []
    argv = ["--model", "M", "--out", str(out), *extra]
    line = _said(command, argv, time.time(), capsys)
    assert line == (f"error: interrupted (SIGTERM); no length was finished, nothing was saved in --out {out}: run the "
                    "command again")
    line = _said(command, [*argv, "--resume"], time.time(), capsys, KeyboardInterrupt())
    assert line.startswith(f"error: interrupted (Ctrl-C); the results so far are saved in {out / name} "), line


def test_ppl_and_generate_say_what_they_would_have_written(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "o"
    assert _said("ppl", ["--model", "M", "--text", "T", "--out", str(out)], time.time(), capsys) == (
        f"error: interrupted (SIGTERM); nothing was written (--out {out} gets ppl.json when every document is "
        "done): run it again")
    generate = ["--model", "M", "--document", "D", "--question", "Q"]
    assert _said("generate", generate, time.time(), capsys).endswith("; no answer: run it again")  # --out optional
    assert _said("generate", [*generate, "--out", str(out)], time.time(), capsys).endswith(
        "; nothing was written: run it again")


def test_a_forced_run_stopped_before_its_first_length_does_not_claim_the_old_grid(tmp_path, monkeypatch, capsys):
    """End to end (in-process, the signal stood in for by its exception): --force over an earlier run's
    results.json, stopped before any length of its own. The old grid was not this run's: saying 'saved, --resume to
    go on' sent the user to extend results the run was replacing. The run's start is taken as the block begins."""
    import megatron_ext.evaluate.niah as niah
    from megatron_ext.evaluate.cli import main
    from tests.unit.test_evaluate import save_tiny

    monkeypatch.delenv("RANK", raising=False)
    model = save_tiny(tmp_path / "hf")
    out = tmp_path / "o"
    _results(out, "results.json", age=3600)

    def stopped(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr(niah, "run_niah", stopped)
    with pytest.raises(SystemExit) as exited:
        main(["--model", str(model), "--out", str(out), "--lengths", "64", "--depths", "50", "--force",
              "--no-progress"])
    assert exited.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: interrupted (SIGTERM); no length was finished, nothing was saved in --out {out}: run the command "
        "again")
