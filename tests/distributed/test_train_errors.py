"""Trainer bad input: one clear line on stderr and exit 1, before training starts."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"


def train(*overrides):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(RECIPE), *overrides],
                          capture_output=True, text=True, env=env, timeout=300)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_data_shorter_than_one_global_batch(tmp_path, token_data):
    proc = train(f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "parallel.context=1",
                 "train.seq_length=4096", "train.global_batch_size=64", "train.steps=1")
    assert_one_line_error(proc, "data.prefix", "fewer than one global batch", "64 x 4096")


@pytest.mark.parametrize("overrides, fragments", [
    (["data.prefix=/nonexistent/cpt"], ["data.prefix = '/nonexistent/cpt'", "tools/prepare_data.py"]),
    (["checkpoint.init_from=/nonexistent/ckpt"], ["checkpoint.init_from = '/nonexistent/ckpt'", "not a folder"]),
    (["parallel.context=2"], ["tensor x pipeline x context = 1 x 1 x 2 = 2 does not divide the world size = 1"]),
    (["train.lerning_rate=1"], ["train.lerning_rate: unknown key"]),
    (["runtime.fp8=hybrid"], ["runtime.fp8 = 'hybrid'"]),
])
def test_static_mistakes(tmp_path, token_data, overrides, fragments):
    base = [f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "parallel.context=1"]
    proc = train(*base, *overrides)
    assert_one_line_error(proc, *fragments)


def test_missing_checkpoint_dir(token_data):
    proc = train(f"data.prefix={token_data}", "parallel.context=1", "checkpoint.dir=null")
    assert_one_line_error(proc, "checkpoint.dir: missing")
