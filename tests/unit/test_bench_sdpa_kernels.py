"""bench/sdpa_kernels_bench.py stays runnable on CPU at toy shapes (its numbers mean something only on a GPU)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = str(ROOT / "bench/sdpa_kernels_bench.py")


def test_sdpa_kernels_bench_runs_at_toy_size(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--lengths", "64,128", "--heads", "4", "--kv-heads", "2",
                           "--head-dim", "16", "--iters", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("sdpa_kernels-cpu-*.json")
    rows = json.loads(path.read_text())["rows"]
    by = {(r["length"], r["kernel"]): r for r in rows}
    for length in (64, 128):
        assert by[length, "auto"]["time_ratio"] == 1.0
        for kernel in ("auto", "flash", "math"):  # the kernels this CPU has, GQA included
            row = by[length, kernel]
            assert row["status"] == "ok" and row["tflops"] > 0 and row["max_abs_out_diff"] < 1e-5
            # causal count: 6 x d_attn x (L + 1) per token, L tokens
            assert row["tflops"] * 1e12 * row["step_s"] == pytest.approx(6 * 64 * (length + 1) * length)
        # a kernel that refuses the shape is recorded, then tried with K/V expanded to all heads
        assert by[length, "efficient"]["status"] == by[length, "efficient+expand"]["status"] == "unsupported"
    bad = subprocess.run([sys.executable, BENCH, "--heads", "6", "--kv-heads", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 1 and "--kv-heads" in bad.stderr and "Traceback" not in bad.stderr


def test_time_guard_skips_per_kernel(tmp_path):
    """With no budget left, the first kernel runs (nothing to predict from yet); every later one is skipped."""
    proc = subprocess.run([sys.executable, BENCH, "--lengths", "64,128", "--heads", "4", "--kv-heads", "2",
                           "--head-dim", "16", "--iters", "1", "--budget-s", "0.001", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("sdpa_kernels-cpu-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert (rows[0]["length"], rows[0]["kernel"], rows[0]["status"]) == (64, "auto", "ok")
    assert {r["length"] for r in rows[1:]} == {64, 128}
    assert all(r["status"] == "skipped" and "time budget" in r["error"] for r in rows[1:])
