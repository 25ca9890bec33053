"""Pins of `megatron_ext.cost_model` found by a hand mutation audit (round 6): formula terms the planner tests did
not tell apart on the shapes they use (Llama-3.1-8B has heads x head_dim = hidden; its vocabulary is already a
multiple of 128). Oracles: perf.md §5a/§5b/§6 (../shared/research/perf.md) and Megatron-LM's vocabulary padding."""

import pytest

from megatron_ext import cost_model as C

# A Llama-family shape whose attention width differs from the hidden size (Qwen3-4B-like: 32 x 128 = 4096 vs 2560)
WIDE_ATTN = C.Shape(layers=36, hidden=2560, ffn=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936)


def test_padded_vocab_rounds_up():
    """Megatron-LM pads GPT-2's 50257 tokens to 50304 (a multiple of 128); never below the vocabulary (the model
    builder takes its rows from here, so comparing the two cannot catch this)."""
    assert C.padded_vocab(50257, 128, 1) == 50304
    assert C.padded_vocab(50257, 128, 3) == 50304  # lcm(128, 3) = 384 and 131 x 384 = 50304
    assert C.padded_vocab(50305, 128, 1) == 50432


def test_attention_core_flops_use_heads_times_head_dim():
    """perf.md §5a: the attention core is 6 n_layers d_attn (L + 1) per token with d_attn = n_heads x head_dim,
    not the hidden size (the two differ here)."""
    L = 32768
    f = C.train_flops_per_token(WIDE_ATTN, L)
    assert f - 6.0 * C.matmul_params(WIDE_ATTN) == 6 * 36 * (32 * 128) * (L + 1)


LLAMA31_8B = C.Shape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)


def test_chunked_loss_head_chunk_is_at_most_the_micro_batch():
    """A micro-batch of 1,000 tokens with 2,048-token chunks holds one chunk of 1,000 tokens' logits (+ fp32 copy:
    6 B x V per token, perf.md §5b), the bf16 weight-sized product (2 B x V x h) and 4 B of log-sum-exp per token."""
    V, h = 128256, 4096
    got = C.loss_head_bytes(LLAMA31_8B, 1000, V, loss_head="chunked", chunk_tokens=2048)
    assert got == 1000 * 6 * V + 2 * V * h + 4 * 1000


def test_memory_fits_in_marketed_decimal_gb():
    """perf.md §6 counts memory and GPU capacities in decimal GB: 4M tokens at CP 16 without recompute need ~186 GB,
    more than B200's 180 GB (though less than 180 GiB = 193 GB), so the smallest CP that fits is 32 (~100 GB)."""
    need = {cp: C.hand_need_bytes(LLAMA31_8B, 1 << 22, cp, "none") / 1e9 for cp in (16, 32)}
    assert need[16] == pytest.approx(186, abs=1) and need[32] == pytest.approx(100, abs=1)
    assert C.min_context_hand(LLAMA31_8B, 1 << 22, C.GPUS["b200-180gb"], "none") == 32


def test_local_kernels_activation_hand_count():
    """The local (CPU) path's saved tensors of one Llama-3.1-8B layer per token at TP 1, itemised as the docstring
    lists them: 2 RMSNorms x (input, normalised input, output: 3 x 2h B + 4 B fp32 rstd); fused QKV (2 x 6144 B),
    rotated Q and K (2 x 5120 B), SDPA output (2 x 4096 B) and an fp32 log-sum-exp per head (4 x 32 B); RoPE cos/sin
    for Q and K (2 x 4 x 128 B); the MLP's 5 ffn-wide bf16 tensors (2 x 5 x 14336 B)."""
    norms = 2 * (3 * 2 * 4096 + 4)
    attn = 2 * 6144 + 2 * 5120 + 2 * 4096 + 4 * 32
    assert C.activation_bytes_per_token_layer(LLAMA31_8B, 1, kernels="local") == \
        norms + attn + 2 * 4 * 128 + 2 * 5 * 14336 == 224_392


def test_block_recompute_of_every_layer_or_more_is_full_recompute():
    """perf.md §5b/§6 full recompute at TP 8 with SP: 1 KB/token/layer of inputs + two layers' working set
    (17,408 B each); recompute_layers at or above the layer count is that, 0 is no recompute (557,056 B/token)."""
    full = 32 * 1024 + 2 * 17_408
    for n in (None, 32, 40):
        assert C.activation_bytes(LLAMA31_8B, 1, 32, "full", 8, recompute_layers=n) == full, n
    assert C.activation_bytes(LLAMA31_8B, 1, 32, "full", 8, recompute_layers=0) == 557_056
