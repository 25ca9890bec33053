"""The evaluation plan (megatron_ext.eval_plan): memory against the engine measured on CPU, prefill time against a
published prefill, the KV cache against perf.md, and `tools/plan.py --eval`."""

import copy
import subprocess
import sys

import pytest
import torch

from megatron_ext.cost_model import GB, GPUS, Shape, kv_cache_bytes_per_token, shape_from_hf_config
from megatron_ext.eval_plan import (eval_plan, layer_working_set_bytes, min_eval_context, niah_pass_flops,
                                    prefill_flops)
from megatron_ext.presets import LLAMA31_8B, TINY
from megatron_ext.recipe import RecipeError
from tests.conftest import ROOT

H100 = GPUS["h100-80gb"]
L8B = shape_from_hf_config(LLAMA31_8B)
L405B = Shape(126, 16384, 53248, 128, 8, 128, 128256)  # Llama 3.1 405B


@pytest.mark.parametrize("hidden, ffn, heads", [(256, 1024, 8), (256, 2048, 8), (512, 1024, 16)])
@pytest.mark.parametrize("cache", [False, True], ids=["no_cache", "cache"])
def test_working_set_is_the_engines_measured_peak(cpu_parallel_state, hidden, ffn, heads, cache):
    """The engine's prefill on CPU (local kernels, fp32, CP 1): the peak the profiler's allocator events show above
    the weights is one layer's working set, plus the KV cache it records."""
    from bench.measure import cpu_peak_allocated_bytes
    from megatron_ext.evaluate.parallel import MegatronGreedy
    from megatron_ext.model import BuildOptions, build_model

    cfg = {**copy.deepcopy(TINY), "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512}
    model = build_model(cfg, BuildOptions(device="cpu", attention="sdpa", seq_length=2048, loss_head="chunked"))
    gen = MegatronGreedy(model.eval(), 512, 1, kv_cache=cache)
    ids = torch.randint(3, 500, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        measured = cpu_peak_allocated_bytes(lambda: gen.predict(ids, 2047))
    shape = shape_from_hf_config(cfg)
    planned = layer_working_set_bytes(shape, 2048, 1, 1, 4.0, "local")
    planned += kv_cache_bytes_per_token(shape, 4.0) * 2048 if cache else 0
    assert measured == pytest.approx(planned, rel=0.03)
    # negative control: TE's fused SwiGLU count (3 ffn) does not describe the local MLP
    assert layer_working_set_bytes(shape, 2048, 1, 1, 4.0, "te") < 0.85 * measured


@pytest.mark.parametrize("hidden, ffn, heads, kv_heads, head_dim", [(256, 1024, 8, 2, 32), (256, 256, 16, 16, 64)],
                         ids=["gqa", "mha_small_mlp"])
def test_a_pass_after_a_shared_prefix_peaks_below_the_prefill(cpu_parallel_state, hidden, ffn, heads, kv_heads,
                                                              head_dim):
    """A prompt sharing its first half with the cached one runs an extension pass (the whole sequence's K/V of a
    layer assembled at once, `kv_cache.extending`): measured, its peak stays below the full prefill's, so the plan
    of the prefill (above) covers it, even where K/V is large against the MLP (MHA, small FFN)."""
    from bench.measure import cpu_peak_allocated_bytes
    from megatron_ext.evaluate.parallel import MegatronGreedy
    from megatron_ext.model import BuildOptions, build_model

    cfg = {**copy.deepcopy(TINY), "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 512}
    model = build_model(cfg, BuildOptions(device="cpu", attention="sdpa", seq_length=2048, loss_head="chunked"))
    gen = MegatronGreedy(model.eval(), 512, 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (2048,), generator=g).tolist()
    other = ids[:1024] + torch.randint(3, 500, (1024,), generator=g).tolist()
    with torch.no_grad():
        prefill = cpu_peak_allocated_bytes(lambda: gen.predict(ids, 2047))
        extension = cpu_peak_allocated_bytes(lambda: gen.predict(other, 2047))
    assert (gen.passes, gen.extensions) == (1, 1)
    shape = shape_from_hf_config(cfg)
    whole_kv = kv_cache_bytes_per_token(shape, 4.0) / shape.layers * 2048  # one layer's K/V of the sequence
    assert extension < prefill
    if kv_heads == heads:  # where K/V is large: more than its tokens' working set, the layer's whole K/V besides
        assert layer_working_set_bytes(shape, 1024, 1, 1, 4.0, "local") + whole_kv < extension


def test_prefill_time_against_a_published_prefill():
    """perf.md §3d: Llama 3 405B, 1M-token prefill on 128 H100 (CP 16 x TP 8) in 77 s at 63% FLOPS utilization
    (arXiv 2411.01783). Our causal count at the same utilization: 67 s (their count may differ). (In bf16 the weights
    alone, 101 GB per GPU at TP 8, would not fit an H100: that run's weights were not bf16.)"""
    p = eval_plan(L405B, H100, 1 << 20, gpus=128, tensor=8, context=16, mfu=0.63)
    assert p.prefill_s == pytest.approx(77, rel=0.15)
    assert p.memory.weights > 100 * GB and not p.fits


def test_prefill_flops_are_a_third_of_training_without_the_output_layer():
    from megatron_ext.cost_model import train_flops_per_token

    n = 1 << 17
    head = 6.0 * L8B.hidden * L8B.vocab  # training FLOPs per token of the output layer
    assert prefill_flops(L8B, n) == pytest.approx(n * (train_flops_per_token(L8B, n) - head) / 3, rel=1e-12)


def test_cache_weights_and_decode_step_of_llama31_8b():
    """perf.md §5b: 128 KiB of KV cache per token in bf16; 1M tokens at TP 8 x CP 4 leave 4 GiB on each GPU."""
    p = eval_plan(L8B, H100, 1 << 20, gpus=32, tensor=8, context=4)
    assert p.memory.kv_cache == 4 * 2**30
    assert p.memory.weights == pytest.approx(2.0 * 8.03e9 / 8, rel=0.02)  # bf16 weights / TP (embeddings split too)
    assert p.decode_step_s == pytest.approx((p.memory.weights + p.memory.kv_cache) / 3.35e12)
    pp = eval_plan(L8B, H100, 1 << 20, gpus=64, tensor=8, pipeline=2, context=4)
    assert pp.prefill_s == p.prefill_s  # stages take turns on one prompt
    assert pp.memory.kv_cache == p.memory.kv_cache / 2  # each stage reads half, one after the other:
    assert pp.decode_step_s == pytest.approx(p.decode_step_s, rel=1e-3)  # the same step time


def test_a_pass_after_a_prefix_costs_its_positions_exactly():
    """prefill_flops(L) - prefill_flops(c): each position i of c .. L - 1 costs 2 N_matmul and 4 d_attn (i + 1)
    per layer (causal attention to itself and every earlier position): the sum, position by position."""
    from megatron_ext.cost_model import layer_matmul_params

    s, length, c = L8B, 96, 40
    per_position = [s.layers * (2 * layer_matmul_params(s) + 4 * s.heads * s.head_dim * (i + 1))
                    for i in range(length)]
    assert prefill_flops(s, length) - prefill_flops(s, c) == sum(per_position[c:])
    assert prefill_flops(s, length) == sum(per_position)


def test_niah_grid_passes_with_shared_prefixes():
    """A NIAH grid by depth with the KV cache kept: each prompt after the first runs only after the haystack it
    shares with its replica's previous prompt (depths evenly spread; under an eighth shared: a full pass)."""
    n = 1 << 20
    F = lambda c: prefill_flops(L8B, c)  # noqa: E731
    assert niah_pass_flops(L8B, n, 1) == F(n)
    assert niah_pass_flops(L8B, n, 2) == 2 * F(n)  # depth 100% after depth 0: nothing shared
    # 11 depths: prompt j + 1 shares j/10 of the prompt; j = 1 (10%) is under an eighth
    assert niah_pass_flops(L8B, n, 11) == pytest.approx(11 * F(n) - sum(F(round(j / 10 * n)) for j in range(2, 10)),
                                                        rel=1e-12)
    # two replicas: 0, 2, .., 10 and 1, 3, .., 9, each sharing with its own previous prompt
    assert niah_pass_flops(L8B, n, 11, first=0, step=2) == pytest.approx(
        6 * F(n) - sum(F(round(j / 10 * n)) for j in (2, 4, 6, 8)), rel=1e-12)
    assert niah_pass_flops(L8B, n, 11, first=1, step=2) == pytest.approx(
        5 * F(n) - sum(F(round(j / 10 * n)) for j in (3, 5, 7)), rel=1e-12)
    # what is left of 11 full prefills: where the matmuls dominate (4K) the share of positions run,
    # 1 - (0.2 + .. + 0.9) / 11 = 0.60; where attention does (4M) the share of causal pairs, 1 - (0.2^2 + ..) / 11
    short, long_ = (niah_pass_flops(L8B, m, 11) / (11 * prefill_flops(L8B, m)) for m in (1 << 12, 1 << 22))
    assert short == pytest.approx(1 - sum(j / 10 for j in range(2, 10)) / 11, abs=0.015)
    assert long_ == pytest.approx(1 - sum((j / 10) ** 2 for j in range(2, 10)) / 11, abs=0.005)
    p = eval_plan(L8B, H100, 1 << 22, gpus=64, tensor=8, context=8)  # DP 1
    assert p.niah_hours(L8B, 11, 16) == pytest.approx(p.grid_hours(11, 16) * long_, rel=0.01)  # decode steps: small
    two = eval_plan(L8B, H100, 1 << 22, gpus=64, tensor=8, context=2)  # DP 4: the slowest replica sets the time
    assert two.niah_hours(L8B, 11) == pytest.approx(
        max(niah_pass_flops(L8B, 1 << 22, 11, first=r, step=4) for r in range(4)) / two.prefill_flops
        * two.prefill_s / 3600, rel=1e-12)
    with pytest.raises(ValueError, match="depths"):
        niah_pass_flops(L8B, n, 0)


def test_smallest_cp_that_fits():
    cp = min_eval_context(L8B, H100, 1 << 22, gpus=64, tensor=8)
    assert cp == 4
    assert eval_plan(L8B, H100, 1 << 22, gpus=64, tensor=8, context=cp).fits
    assert not eval_plan(L8B, H100, 1 << 22, gpus=64, tensor=8, context=cp // 2).fits
    assert min_eval_context(L8B, H100, 1 << 22, gpus=8, tensor=8) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"gpus": 12, "tensor": 8}, "must divide the 12 GPUs"),
    ({"gpus": 16, "tensor": 16}, "must divide the 32 attention heads and 8 KV heads"),
    ({"gpus": 8, "tensor": 8, "mfu": 0}, "mfu"),
])
def test_layout_errors(kwargs, message):
    with pytest.raises(RecipeError, match=message):
        eval_plan(L8B, H100, 1 << 20, **kwargs)


def _tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools/plan.py"), *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_tool_eval_table_and_advice():
    ok = _tool("recipes/cpt_4m.yaml", "--eval", "128K,1M,4M", "--gpus", "64", "--cp", "8")
    assert ok.returncode == 0, ok.stderr
    assert "TP 8 x PP 1 x CP 8, DP 1" in ok.stdout and ok.stdout.count(" yes ") == 3 and "4,194,304" in ok.stdout
    assert "11 prompts h as NIAH h" in ok.stdout  # every prompt a full prefill, and with shared prefixes
    short = _tool("recipes/cpt_4m.yaml", "--eval", "4M", "--gpus", "64", "--cp", "2")
    assert short.returncode == 1 and "NO" in short.stdout
    assert short.stderr.strip().endswith("use --cp 4 (tools/niah.py --cp 4)")
    bad = _tool("recipes/cpt_4m.yaml", "--eval", "4Q")
    assert bad.returncode == 1 and "--eval: '4Q' is not a token count" in bad.stderr
    stray = _tool("recipes/cpt_4m.yaml", "--cp", "8")
    assert stray.returncode == 1 and "plan an evaluation: add --eval LENGTHS" in stray.stderr
    assert "Traceback" not in bad.stderr + short.stderr + stray.stderr


def test_grid_rounds_layout_rope_and_mfu_bounds_by_hand():
    """Hand numbers (mutation audit, round 4): 11 prompts over DP 4 take ceil(11 / 4) = 3 rounds of prefill and of
    decode steps; DP = GPUs / (TP x PP x CP); the RoPE table is fp32 cos/sin of head_dim per position on the rank's
    length / CP positions; mfu = 1 is allowed ((0, 1]); the smallest CP may use every GPU (TP x CP = GPUs)."""
    p = eval_plan(L8B, H100, 1 << 22, gpus=64, tensor=8, context=2)
    assert p.data == 4
    assert p.grid_hours(11) == pytest.approx(3 * p.prefill_s / 3600, rel=1e-12)
    assert p.grid_hours(11, 100) - p.grid_hours(11) == pytest.approx(3 * 100 * p.decode_step_s / 3600, rel=1e-9)
    assert p.niah_hours(L8B, 11, 100) - p.niah_hours(L8B, 11) == pytest.approx(3 * 100 * p.decode_step_s / 3600,
                                                                               rel=1e-9)
    assert eval_plan(L8B, H100, 1 << 20, gpus=64, tensor=8, pipeline=2, context=2).data == 2  # 64 / (8 * 2 * 2)
    assert eval_plan(L8B, H100, 1 << 20, gpus=32, tensor=8, context=4).memory.rope == 4 * 128 * (1 << 20) / 4
    assert eval_plan(L8B, H100, 1 << 20, gpus=8, tensor=8, mfu=1.0).prefill_s > 0
    assert min_eval_context(L8B, H100, 1 << 22, gpus=32, tensor=8) == 4  # TP 8 x CP 4 on all 32 GPUs


def test_a_prefix_of_exactly_an_eighth_is_reused():
    """MIN_SHARED_PREFIX is inclusive: 9 depths over 1024 tokens share 128 j tokens with the prompt before (j = 1 ..
    7); 128 is exactly an eighth of 1024, so that prompt too runs only its positions after the shared prefix."""
    F = lambda c: prefill_flops(L8B, c)  # noqa: E731
    assert niah_pass_flops(L8B, 1024, 9) == pytest.approx(9 * F(1024) - sum(F(128 * j) for j in range(1, 8)),
                                                          rel=1e-12)


def test_te_context_parallel_ring_holds_two_kv_chunks():
    """TE's p2p ring under CP keeps two chunks of K/V (this rank's and the one in flight), 2 x length / CP tokens, on
    top of the attention phase's activations; by hand for a shape where attention outweighs the MLP: h 64, ffn 64,
    8 heads and 8 KV heads of 8, TP 1, CP 2 on 1024 tokens (512 per rank), 2-byte values."""
    s = Shape(2, 64, 64, 8, 8, 8, 512)
    tokens = 512
    attention = tokens * 2 * (3 * 64 + (8 + 16) * 8 + 16 * 8 + 64)
    ring = 2 * tokens * 2 * 8 * 8 * 2  # two chunks of K and V, kv_heads x head_dim each, bf16
    assert attention + ring > tokens * 2 * (4 * 64 + 3 * 64)  # the MLP phase
    assert layer_working_set_bytes(s, 1024, 1, 2) == attention + ring
