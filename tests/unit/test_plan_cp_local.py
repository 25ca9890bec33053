"""The planner's torch SDPA path under context parallelism at scale: the whole sequence's K and V that every layer
gathers and keeps (measured on gloo CP groups: tests/distributed/test_plan_memory_cp.py), and TE paths unchanged."""

import time

from megatron_ext import cost_model as C
from megatron_ext import plan as P
from megatron_ext.presets import LLAMA31_8B
from megatron_ext.recipe import load_recipe

S8B = C.shape_from_hf_config(LLAMA31_8B)
GB = C.GB


def _cpt_4m_sdpa():
    return load_recipe("recipes/cpt_4m.yaml", ["runtime.attention=sdpa", "parallel.sequence_parallel=false",
                                               "parallel.context=64", "cluster.nodes=64"])


def test_gathered_kv_per_layer_at_4m_is_independent_of_cp():
    """4M tokens, TP 8 (1 KV head per rank), bf16: 4,194,304 x 2 x 128 x 2 B = 2.15 GB per layer at any CP, in place
    of the rank's QKV buffer and rotated K (3 x its K: 768 B per token), one more output copy being in both counts."""
    gathered = C.gathered_kv_bytes(S8B, 1 << 22, 8)
    assert gathered == (1 << 22) * 2 * 128 * 2
    cp1 = C.activation_bytes_per_token_layer(S8B, 8, False, 2.0, "local")
    for cp in (16, 32, 64):
        tokens = (1 << 22) // cp
        extra = (C.activation_bytes_per_token_layer(S8B, 8, False, 2.0, "local", context=cp) - cp1) * tokens
        assert extra == gathered - tokens * 3 * 128 * 2
    assert 2.09 * GB < extra < 2.1 * GB  # CP 64


def test_te_and_cp1_paths_unchanged():
    for t, sp in ((1, True), (8, True), (8, False)):
        te = C.activation_bytes_per_token_layer(S8B, t, sp, 2.0, "te", True)
        assert all(C.activation_bytes_per_token_layer(S8B, t, sp, 2.0, "te", True, cp) == te for cp in (2, 64))
        local = C.activation_bytes_per_token_layer(S8B, t, sp, 2.0, "local")
        assert C.activation_bytes_per_token_layer(S8B, t, sp, 2.0, "local", context=1) == local
    assert C.cp_buffer_bytes(S8B, 65536, 8, 64) == 65536 * (4 * 2 * 128 * 2 + 4.0 * 4 * 128)  # TE p2p ring
    assert C.cp_buffer_bytes(S8B, 65536, 8, 1, kernels="local") == 0.0
    te = load_recipe("recipes/cpt_4m.yaml", ["parallel.context=64", "cluster.nodes=64"])
    assert P.kernels_of(te) == "te"
    m = P.plan(te, C.GPUS["h200-141gb"], 512).memory
    assert m.cp_buffers == C.cp_buffer_bytes(S8B, 65536, 8, 64)


def test_4m_sdpa_recommendation_fits_with_the_gathered_kv():
    """cpt_4m, 512 x H200, sdpa, no SP, CP 64: the planner recommended recomputing 10 of 32 layers at 124.0 GB when it
    left the gathered K/V out; the 22 other layers keep 2.1 GB each more than it counted: 175 GB, over 141."""
    recipe, gpu = _cpt_4m_sdpa(), C.GPUS["h200-141gb"]
    old = P.plan(recipe, gpu, 512, recompute="full", recompute_layers=10)
    assert not old.fits and old.memory.total > 170 * GB
    start = time.perf_counter()
    best = P.recommend(recipe, gpu, 512)
    assert time.perf_counter() - start < 30
    assert best.fits and not best.tight and best.context == 64 and best.recompute == "full"
    kept = 32 - best.recompute_layers
    per_layer = C.activation_bytes_per_token_layer(S8B, 8, False, 2.0, "local", True, 64) * 65536
    assert per_layer > C.gathered_kv_bytes(S8B, 1 << 22, 8)
    # every kept layer's saved tensors incl. its gathered K/V, and one layer's K/V gradients in backward
    assert best.memory.activations >= kept * per_layer
    assert best.memory.cp_buffers >= 2 * C.gathered_kv_bytes(S8B, 1 << 22, 8)
    print(f"recommended recompute_layers={best.recompute_layers}: {best.memory.total / GB:.1f} GB")
