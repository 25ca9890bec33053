"""Pins of a save's run metadata (megatron_ext.checkpoint_run_metadata) from the mutation audit (round 7): the git
commit it records (checked against git itself, in a repository made for the test), the save time in UTC and the
values a caller's metadata may hold that JSON has no type for."""

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
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
