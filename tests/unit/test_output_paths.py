"""Outputs that cannot be written are found before the work, as one `error:` line naming the option, the path and
the fix; they were tracebacks after it (`prepare_data.py cpt/sft --output` after the tokenizer load and the read,
`prepare_data.py toy --out` after training the tokenizer, `checkpoint.py reshard --out` from every rank after the
load). /proc/... stands for any path where no folder can be made (a read-only or virtual file system; tests run as
root, which no file mode stops). Also `--tokenizer` given the tokenizer.json file instead of its folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.data import DataError
from megatron_ext.data.common import load_tokenizer
from megatron_ext.data.toy import synthetic_chats, synthetic_corpus, write_jsonl
from tests.conftest import ROOT
from tools.prepare_data import main as prepare_data

pytestmark = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no folder can be made")

NOWHERE = "/proc/megatron_ext_test"


def _exit_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        prepare_data(argv)
    assert capsys.readouterr().err == ""  # nothing before the error: no progress of work that is thrown away
    return str(caught.value.code)


def test_folder_write_problem(tmp_path):
    from megatron_ext.cli_types import folder_write_problem

    assert folder_write_problem(tmp_path / "a" / "b") is None and list(tmp_path.iterdir()) == []  # nothing left
    assert folder_write_problem(tmp_path) is None and list(tmp_path.iterdir()) == []
    assert folder_write_problem(f"{NOWHERE}/x") == ("cannot create a folder there (No such file or directory in "
                                                    "/proc); choose a writable path")
    (tmp_path / "file").write_text("")
    assert folder_write_problem(tmp_path / "file" / "x") == f"{tmp_path / 'file'} is a file, not a directory; choose a " \
                                                            "writable path"


@pytest.mark.parametrize("kind", ["cpt", "sft"])
def test_prepare_data_output_that_cannot_be_written(kind, tmp_path, toy_tokenizer, capsys):
    records = synthetic_corpus(4, seed=0) if kind == "cpt" else synthetic_chats(4, seed=0)
    data = write_jsonl(tmp_path / "in.jsonl", records)
    extra = ["--seq-length", "256"] if kind == "sft" else []
    code = _exit_line(capsys, [kind, "--input", str(data), "--tokenizer", toy_tokenizer, "--output", "/proc/x",
                               "--quiet", *extra])
    assert code == ("error: --output /proc/x: cannot create a folder there (No such file or directory in /proc); "
                    "choose a writable path")


def test_toy_out_that_cannot_be_created(capsys):
    code = _exit_line(capsys, ["toy", "--out", f"{NOWHERE}/toy"])
    assert code == (f"error: --out {NOWHERE}/toy: cannot create a folder there (No such file or directory in "
                    "/proc); choose a writable path")


def test_tokenizer_file_instead_of_its_folder(tmp_path, toy_tokenizer, capsys):
    file = Path(toy_tokenizer) / "tokenizer.json"
    with pytest.raises(DataError, match=rf"^--tokenizer {file}: is a file, but --tokenizer takes the folder of a "
                                        rf"tokenizer; give its folder: --tokenizer {toy_tokenizer}$"):
        load_tokenizer(str(file))
    other = tmp_path / "vocab.txt"
    other.write_text("a\n")
    with pytest.raises(DataError, match=r"is a file, but --tokenizer takes the folder of a tokenizer; pass an HF "
                                        r"tokenizer folder"):
        load_tokenizer(str(other))
    data = write_jsonl(tmp_path / "in.jsonl", synthetic_corpus(4, seed=0))
    code = _exit_line(capsys, ["cpt", "--input", str(data), "--tokenizer", str(file), "--output",
                               str(tmp_path / "cpt"), "--quiet"])
    assert code.startswith(f"error: --tokenizer {file}: is a file") and not list(tmp_path.glob("cpt*"))


def _run_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint root whose metadata is what a training run of the tiny recipe records (no shards: what is
    checked here is read before them)."""
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes/tiny/cpt.yaml", ["parallel.context=1"], world_size=1)
    root = tmp_path / "run"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    meta = {"hf_config": hf_config_from_recipe(recipe), "recipe": recipe.to_dict(), "has_optimizer": True,
            "parallel": {"tensor": 1, "pipeline": 1, "context": 1, "data": 1}}
    (root / "iter_0000002" / "megatron_ext.json").write_text(json.dumps(meta))
    return root


def test_reshard_out_that_cannot_be_created(tmp_path, monkeypatch, capsys):
    from megatron_ext import runtime
    from megatron_ext.checkpoint_cli import main

    def no_process_group(*args, **kwargs):
        raise AssertionError("reshard went on to the load")

    monkeypatch.setattr(runtime, "init_distributed", no_process_group)
    root = _run_checkpoint(tmp_path)
    code = main(["reshard", str(root), "--out", f"{NOWHERE}/new"])
    err = capsys.readouterr().err
    assert code == 1 and err == (f"error: --out {NOWHERE}/new: cannot create a folder there (No such file or "
                                 "directory in /proc); choose a writable path\n")


def test_reshard_out_check_ignores_another_ranks_probe(tmp_path):
    """Every rank runs the checks at once: another's probe file, there for a moment, is no content."""
    from megatron_ext.checkpoint_reshard import reshard_plan
    from megatron_ext.cli_types import WRITE_PROBE_PREFIX

    root = _run_checkpoint(tmp_path)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / f"{WRITE_PROBE_PREFIX}abc").write_text("")
    path, _, overrides = reshard_plan(root, tmp_path / "new", None, 1)
    assert path == root / "iter_0000002" and f"checkpoint.dir={tmp_path / 'new'}" in overrides


def test_whole_number_accepts_its_minimum():
    """cli_types.whole_number(m): an integer >= m (argparse semantics: the type raises ArgumentTypeError below it).
    The boundary itself is valid: iteration 0 (checkpoint_cli), a count of 1 (launch). Mutation audit round 3."""
    import argparse

    from megatron_ext.cli_types import whole_number

    assert whole_number(0)("0") == 0 and whole_number(1)("1") == 1 and whole_number(1)("7") == 7
    for minimum, text in ((0, "-1"), (1, "0"), (1, "x"), (1, "1.5")):
        with pytest.raises(argparse.ArgumentTypeError):
            whole_number(minimum)(text)
