"""SIGTERM (scancel, a time limit, kill) during a conversion: the model-sized temporary folder is removed,
an existing --out stays as it was, and the command ends with one `error:` line (no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.test_convert_fixtures import make_hf_model


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("sig") / "hf")


@pytest.fixture(scope="module")
def mcore(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("sig_m") / "m"
    proc = subprocess.run([sys.executable, str(ROOT / "tools/convert.py"), "to-megatron", "--hf", str(src), "--out",
                           str(out), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def _wait_for(pattern: str, parent: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not list(parent.glob(pattern)):
        assert proc.poll() is None, f"conversion ended before {pattern} appeared: {proc.communicate()}"
        assert time.time() < deadline, f"{pattern} did not appear"
        time.sleep(0.01)


@pytest.mark.parametrize("direction", ["to-megatron", "to-hf"])
def test_sigterm_removes_temporary_output_and_keeps_old_out(direction, src, mcore, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("previous conversion")
    source = ["--hf", str(src)] if direction == "to-megatron" else ["--megatron", str(mcore)]
    # --verify keeps the process busy (loading transformers) after the output is written in the temp folder
    cmd = [sys.executable, str(ROOT / "tools/convert.py"), direction, *source, "--out", str(out), "--force",
           "--verify", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    written = "latest_checkpointed_iteration.txt" if direction == "to-megatron" else "model.safetensors.index.json"
    _wait_for(f".out.partial-{proc.pid}/{written}", tmp_path, proc)  # the full-size copy exists now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    lines = [ln for ln in err.splitlines() if ln.startswith(("error", "Traceback"))]
    assert lines == [f"error: interrupted (SIGTERM); the unfinished output was removed (--out {out} is replaced "
                     "only by a complete conversion)"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.partial-* / .out.old-* left
    assert sorted(p.name for p in out.iterdir()) == ["keep"]
