"""bench/report.py: the benchmark's arithmetic, table and helpers, checked exactly."""

import json
import math

import pytest

from bench.report import (
    bucket_kernels, format_table, median, parse_lengths, predict_step_s, ratios, throughput, write_json_atomic,
)
from megatron_ext.cost_model import matmul_params, shape_from_hf_config, train_flops_per_token
from megatron_ext.presets import LLAMA31_8B


def test_throughput_exact():
    m = throughput(step_s=2.0, tokens_per_step=32768, flops_per_token=1e10, peak_tflops=1000.0, matmul_tflops=800.0)
    assert m["tokens_per_s"] == 16384.0
    assert m["tflops"] == pytest.approx(163.84)
    assert m["mfu_peak"] == pytest.approx(0.16384) and m["mfu_matmul"] == pytest.approx(0.2048)
    assert throughput(1.0, 1, 1e12, 1000.0, None)["mfu_matmul"] is None
    with pytest.raises(ValueError):
        throughput(0.0, 1, 1.0, 1.0, 1.0)


def test_flops_of_the_benchmark_model_follow_perf_md():
    # 4 full-width layers: 6 N_matmul + 6 layers d_attn (L + 1) (perf.md 5a, causal), by hand.
    s = shape_from_hf_config(dict(LLAMA31_8B, num_hidden_layers=4))
    layer = 4096 * (32 + 16) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336
    assert matmul_params(s) == 4 * layer + 4096 * 128256
    L = 131072
    assert train_flops_per_token(s, L) == 6 * (4 * layer + 4096 * 128256) + 6 * 4 * 4096 * (L + 1)


def test_median():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0]) == 1.5
    with pytest.raises(ValueError):
        median([])


def test_predict_step_s_scales_by_flops_and_recompute():
    flops = {1024: 1.0, 2048: 3.0, 4096: 10.0}.__getitem__
    assert predict_step_s([], 2048, "none", flops, fallback_tflops=1e-12) == 3.0
    known = [(1024, "none", 0.5)]
    assert predict_step_s(known, 2048, "none", flops, 1.0) == pytest.approx(1.5)
    assert predict_step_s(known, 2048, "full", flops, 1.0) == pytest.approx(2.0)  # one extra forward
    # the nearest length wins: 4096 scales from 2048, not 1024
    assert predict_step_s(known + [(2048, "full", 4.0)], 4096, "full", flops, 1.0) == pytest.approx(40 / 3)


def _row(stack, length, status="ok", tps=100.0, **kw):
    r = {"stack": stack, "length": length, "recompute": "none", "status": status, "layers": kw.get("layers", 4)}
    if status == "ok":
        r.update(step_s=1.0, tokens_per_s=tps, tflops=1.0, mfu_peak=0.5, mfu_matmul=0.6, peak_gib=10.0)
    else:
        r["reason"] = kw.get("reason", "out of memory")
    return r


def test_ratios_and_table():
    rows = [_row("ours", 8192, tps=150.0), _row("peer", 8192, tps=100.0), _row("ours", 131072, tps=9.0),
            _row("peer", 131072, "oom", reason="CUDA out of memory")]
    assert ratios(rows) == {8192: 1.5, 131072: None}
    # a fallback run with fewer layers: its own ratio, never mixed with the 4-layer rows
    rows += [_row("ours", 131072, tps=20.0, layers=2), _row("peer", 131072, tps=8.0, layers=2)]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 6
    assert "ours/peer" in lines[0] and "MFU@peak" in lines[0] and "peak_GiB" in lines[0] and "layers" in lines[0]
    row = {tuple(ln.split()[:3]): ln for ln in lines[2:]}
    assert "1.50x" in row["8192", "4", "ours"] and "50.0%" in row["8192", "4", "ours"]
    assert "60.0%" in row["8192", "4", "ours"]
    assert "2.50x" in row["131072", "2", "ours"] and "oom: CUDA out of memory" in row["131072", "4", "peer"]
    assert row["131072", "4", "ours"].split()[-2:] == ["-", "ok"]
    # the ratio sits on the ours row only
    assert "1.50x" not in row["8192", "4", "peer"]


def test_bucket_kernels():
    b = bucket_kernels([("void pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel<...>", 5.0),
                        ("fmha_cutlassF_bf16_aligned_64x64", 1.0),
                        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 7.0),
                        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", 2.0),
                        ("void at::native::vectorized_elementwise_kernel<4, ...>", 3.0),
                        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0.5),
                        ("Memcpy DtoD (Device -> Device)", 0.25), ("mystery_kernel", 0.125)])
    assert b["attention"] == 6.0 and b["gemm"] == 9.0 and b["elementwise/reduce"] == 3.0
    assert b["communication"] == 0.5 and b["copy/cast"] == 0.25 and b["other"] == 0.125
    assert math.isclose(sum(b.values()), 18.875)


def test_parse_lengths():
    assert parse_lengths("128K,8192, 32k") == [8192, 32768, 131072]
    for bad in ("8x", "", "1"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_write_json_atomic(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]
