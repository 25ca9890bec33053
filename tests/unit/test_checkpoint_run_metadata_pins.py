"""Pins of a save's run metadata (megatron_ext.checkpoint_run_metadata) from the mutation audits (rounds 7 and 9): the
git commit it records (checked against git itself, in a repository made for the test, and None without git), the save
time in UTC, the values a caller's metadata may hold that JSON has no type for, the package versions and the layout
outside a parallel run."""

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_ext.checkpoint_run_metadata as run_metadata

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(cwd, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def _module_in(folder: Path):
    """A copy of the module loaded from `folder`: `_git_sha` asks git about the folder its own file is in."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_metadata.__file__, folder / "checkpoint_run_metadata.py")
    spec = importlib.util.spec_from_file_location(f"run_metadata_copy_{folder.name}",
                                                  folder / "checkpoint_run_metadata.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_git_sha_is_the_commit_dirty_only_for_changed_tracked_files(tmp_path, monkeypatch):
    """The commit of the source tree; '-dirty' when a tracked file differs from it, not for an untracked file
    (a run's logs or outputs beside the code: RM3), and not when clean (RM5); None outside git (RM4), not ''."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # the outside-git case cannot find a parent repo
    repo = tmp_path / "repo"
    module = _module_in(repo)
    _git(repo, "init", "-q")
    _git(repo, "add", "checkpoint_run_metadata.py")
    _git(repo, "commit", "-q", "-m", "x")
    head = _git(repo, "rev-parse", "HEAD")
    assert module._git_sha() == head
    (repo / "run.log").write_text("untracked\n")
    assert module._git_sha() == head
    with open(repo / "checkpoint_run_metadata.py", "a") as f:
        f.write("# a local change\n")
    assert module._git_sha() == head + "-dirty"
    assert _module_in(tmp_path / "plain")._git_sha() is None


@dataclasses.dataclass
class _Block:
    size: int
    where: Path


def test_metadata_text_time_versions_and_non_json_values():
    """'created' is UTC, with its offset, to the second (RM6); the versions include megatron-core's installed one,
    which `tools/checkpoint.py info` prints (RM12); a dataclass is saved as its fields, a set as a list and a torch
    dtype and a path as text (RM8-RM10: else the save at the end of a run stops on a TypeError)."""
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    info = json.loads(run_metadata.run_metadata_text(5, {
        "block": _Block(3, Path("/a/b")), "kinds": {"x"}, "dtype": torch.bfloat16}))
    created = datetime.datetime.fromisoformat(info["created"])
    assert created.utcoffset() == datetime.timedelta(0) and created.microsecond == 0, info["created"]
    assert before <= created <= datetime.datetime.now(datetime.timezone.utc)
    assert info["versions"]["megatron-core"] == importlib.metadata.version("megatron-core")
    assert info["versions"]["torch"] == importlib.metadata.version("torch")
    assert info["block"] == {"size": 3, "where": "/a/b"} and info["kinds"] == ["x"]
    assert info["dtype"] == "torch.bfloat16"
    assert info["iteration"] == 5


# mutation audit round 9


def test_git_missing_records_no_commit(tmp_path, monkeypatch):
    """Where git is not installed (not on PATH), the save records git_sha None and goes on (CR5: the
    FileNotFoundError of starting git ended the save)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no git to start
    assert json.loads(run_metadata.run_metadata_text(1, {}))["git_sha"] is None


def test_metadata_file_text_all_versions_the_callers_keys_and_a_last_newline():
    """The installed version of each package the run depends on (importlib.metadata; CR2: transformers left out),
    a caller's key over ours of the same name (the docstring: 'which wins'; CR10), a value JSON cannot hold refused
    with its type named (CR14: written as its str()), and the text ends in a newline (CR13)."""
    text = run_metadata.run_metadata_text(3, {"parallel": {"tensor": 2}, "recipe": {"a": 1}})
    assert text.endswith("}\n")
    info = json.loads(text)
    for pkg in ("megatron-core", "torch", "transformers", "safetensors"):
        assert info["versions"][pkg] == importlib.metadata.version(pkg), pkg
    assert info["parallel"] == {"tensor": 2} and info["recipe"] == {"a": 1}
    with pytest.raises(TypeError, match="metadata value of type complex is not JSON-serialisable"):
        run_metadata.run_metadata_text(3, {"x": 1j})


def test_the_layout_outside_a_parallel_run_is_all_ones():
    """A save from a process that never set up Megatron's parallel state (a conversion): every size 1 (CR6: data 0;
    CR15: the sizes asked of the uninitialised state). In a fresh process: this one's tests may have set it up."""
    code = ("import json, megatron_ext.checkpoint_run_metadata as m\n"
            "print(json.dumps(json.loads(m.run_metadata_text(1, {}))['parallel']))\n")
    root = Path(run_metadata.__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"tensor": 1, "pipeline": 1, "context": 1, "data": 1}
