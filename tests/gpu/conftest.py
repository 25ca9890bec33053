"""Fixtures of the CUDA tests."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT, process_group


@pytest.fixture(scope="module")
def gpu_state():
    """A single-process NCCL group with Megatron parallel state on this machine's first GPU, for one test module."""
    yield from process_group("cuda")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny preset's random HF model (`hf/`) and its conversion by tools/convert.py (`mc/`), in one folder."""
    from tests.unit.test_evaluate import save_tiny

    d = tmp_path_factory.mktemp("tiny_converted")
    save_tiny(d / "hf")
    subprocess.run([sys.executable, str(ROOT / "tools/convert.py"), "to-megatron", "--hf", str(d / "hf"),
                    "--out", str(d / "mc"), "--no-progress"], check=True, cwd=ROOT, capture_output=True)
    return d
