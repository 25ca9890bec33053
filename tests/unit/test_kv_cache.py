"""The KV cache's attention math (megatron_ext.evaluate.kv_cache) against torch SDPA, and RoPE at given positions.

The decode step attends new queries to parts of the keys (a CP rank's cache, the decoded tokens, blocks of a
long cache) and merges the parts by log-sum-exp; the result must be SDPA over all the keys at once. The end-to-end
check against transformers' generation is tests/distributed/test_niah_megatron.py.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.evaluate import kv_cache
from megatron_ext.evaluate.kv_cache import attend, merge
from megatron_ext.presets import TINY
from megatron_ext.rope import RopeConfigError

B, NH, NG, D, N, S = 2, 8, 2, 16, 3, 40


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, NH, N, D, generator=g)
    k, v = torch.randn(B, NG, S, D, generator=g), torch.randn(B, NG, S, D, generator=g)
    # query i sits at position S - N + i: causal over the keys, the last N being the new tokens
    visible = torch.arange(S)[None, :] <= (S - N + torch.arange(N))[:, None]  # [N, S]
    return q, k, v, visible


def sdpa(q, k, v, visible):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=D ** -0.5, enable_gqa=True)


def test_attend_is_sdpa_with_gqa(qkv):
    q, k, v, visible = qkv
    out, lse = attend(q, k, v, visible, D ** -0.5)
    torch.testing.assert_close(out, sdpa(q, k, v, visible), atol=1e-6, rtol=1e-5)
    k_heads = k.repeat_interleave(NH // NG, dim=1)  # head h reads KV head h // 4
    scores = (q @ k_heads.transpose(-1, -2)) * D ** -0.5
    torch.testing.assert_close(lse, scores.masked_fill(~visible, float("-inf")).logsumexp(-1))


@pytest.mark.parametrize("cuts", [(13, 27), (5, 6, 33)])
def test_parts_merged_by_log_sum_exp_are_the_whole(qkv, cuts):
    """Key sets split as over CP ranks, one part with keys no query sees (output 0, log-sum-exp -inf)."""
    q, k, v, visible = qkv
    visible = visible.clone()
    visible[:, 5:6] = False  # (5, 6, 33): the part [5, 6) is invisible to every query
    bounds = [0, *cuts, S]
    parts = [attend(q, k[:, :, a:b], v[:, :, a:b], visible[:, a:b], D ** -0.5) for a, b in zip(bounds, bounds[1:])]
    out, lse = merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out, sdpa(q, k, v, visible), atol=1e-6, rtol=1e-5)
    assert out.isfinite().all() and lse.isfinite().all()
    # negative control: averaging the parts' outputs instead of weighting them by their log-sum-exp
    naive = torch.stack([p[0] for p in parts]).mean(0)
    assert (naive - sdpa(q, k, v, visible)).abs().max() > 1e-2


def test_blocks_of_a_long_cache(qkv, monkeypatch):
    q, k, v, visible = qkv
    monkeypatch.setattr(kv_cache, "KEY_BLOCK", 7)  # 40 keys in 6 blocks, the last one short
    out, _ = attend(q, k, v, visible, D ** -0.5)
    torch.testing.assert_close(out, sdpa(q, k, v, visible), atol=1e-6, rtol=1e-5)


def test_bf16_cache_is_attended_in_fp32(qkv):
    q, k, v, visible = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in qkv)
    out, _ = attend(q, k, v, visible, D ** -0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, sdpa(*(t.float() for t in (q, k, v)), visible), atol=1e-6, rtol=1e-5)


def build(cfg):
    from megatron_ext.model import BuildOptions, build_model

    return build_model(cfg, BuildOptions(device="cpu", attention="sdpa", seq_length=64))


def test_rope_at_given_positions_is_the_full_tables_rows(cpu_parallel_state):
    from tests.unit.test_rope_cp import Rank

    emb = build(copy.deepcopy(TINY)).rotary_pos_emb
    full = emb.local_table(64)  # [64, 1, 1, dim], positions 0 .. 63
    emb.positions = torch.tensor([61, 62, 63])
    assert torch.equal(emb(3), full[61:])
    assert torch.equal(emb(6, cp_group=Rank(2, 1)), full[61:])  # the same on every CP rank
    assert not torch.equal(emb(3), full[:3])  # the positions matter, not the length asked for
    emb.positions = None
    assert torch.equal(emb(64), full)


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_rope_at_given_far_positions_keeps_the_angle_precision(cpu_parallel_state, precision):
    """Decode steps far out (the KV cache hands the embedding its positions) form angles in the model's precision,
    where float32 and float64 angles differ (the control)."""
    from megatron_ext.rope_angles import rope_angles

    emb = build({**copy.deepcopy(TINY), "rope_angle_precision": precision}).rotary_pos_emb
    far = torch.arange((1 << 22) - 3, 1 << 22)
    emb.positions = far
    other = "float32" if precision == "float64" else "float64"
    ours = emb(3)[:, 0, 0, : emb.inv_freq.numel()]
    assert torch.equal(ours, rope_angles(far, emb.inv_freq, precision))
    assert not torch.equal(ours, rope_angles(far, emb.inv_freq, other))


def test_rope_at_given_positions_refuses_a_length_dependent_table(cpu_parallel_state):
    emb = build({**copy.deepcopy(TINY), "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}).rotary_pos_emb
    emb.positions = torch.tensor([5])
    assert emb.length_dependent
    with pytest.raises(RopeConfigError, match="dynamic"):
        emb(1)



def test_reusable_prefix():
    """The cached positions a decode step reuses: the common prefix with the cached ids, at most `first`, and
    nothing (a full pass) when more than `max_new` tokens would be left to run."""
    from megatron_ext.evaluate.kv_cache import ContextParallelKVCache

    cache = ContextParallelKVCache.__new__(ContextParallelKVCache)  # the prefix rule only, no model
    cache.ids = list(range(100))
    assert cache.reusable_prefix(list(range(101)), 100, 64) == 100  # one more token: the usual step
    assert cache.reusable_prefix(list(range(101)), 90, 64) == 90  # predictions wanted from 90: recompute 90..100
    assert cache.reusable_prefix(list(range(95)) + [7, 8], 96, 64) == 95  # a draft left at 95
    assert cache.reusable_prefix(list(range(150)), 149, 64) == 100  # 50 new tokens
    assert cache.reusable_prefix(list(range(200)), 199, 64) is None  # 100 new tokens: a full pass
    assert cache.reusable_prefix([5] + list(range(1, 101)), 100, 64) is None  # another prompt
    assert cache.reusable_prefix(list(range(20)) + [0] * 81, 100, 90) == 20
    # positions the caller vouches for (a row's prompt after its first pass) are not compared, the others are
    assert cache.reusable_prefix([5] + list(range(1, 101)), 100, 64, known_same=1) == 100
    assert cache.reusable_prefix([5] + list(range(1, 30)) + [0] + list(range(31, 101)), 100, 64, known_same=1) is None
    assert cache.reusable_prefix(list(range(95)) + [7, 8], 96, 64, known_same=96) == 95  # the tail still is
    cache.ids = []
    assert cache.reusable_prefix([1, 2, 3], 2, 64) is None  # nothing cached


def test_shared_prefix():
    """The cached positions an extension pass reuses: the common prefix with the cached ids, at most `first` (the
    pass covers the positions to predict) and at most the prefill's valid positions (not the decoded tokens)."""
    from megatron_ext.evaluate.kv_cache import ContextParallelKVCache

    cache = ContextParallelKVCache.__new__(ContextParallelKVCache)  # the prefix rule only, no model
    cache.ids, cache.prefill_valid = list(range(100)), 96  # 96 prompt tokens, 4 decoded
    assert cache.shared_prefix(list(range(40)) + [7] * 60, 99) == 40
    assert cache.shared_prefix(list(range(40)) + [7] * 60, 30) == 30
    assert cache.shared_prefix(list(range(200)), 199) == 96  # the decoded tokens' keys sit outside the prefill
    assert cache.shared_prefix([5] + list(range(1, 100)), 99) == 0
    assert cache.shared_prefix(list(range(50)), 49) == 49  # a prompt inside the cached one
    cache.ids, cache.prefill_valid = [], 0
    assert cache.shared_prefix([1, 2, 3], 2) == 0


def test_reusable_prefix_compares_the_first_position_it_may_reuse():
    """The id at `len(ids) - max_new` (the lowest position a decode step may reuse) is compared too."""
    from megatron_ext.evaluate.kv_cache import ContextParallelKVCache

    cache = ContextParallelKVCache.__new__(ContextParallelKVCache)  # the prefix rule only, no model
    cache.ids = list(range(100))
    ids = list(range(101))
    ids[37] = -1  # 101 - 64 = 37
    assert cache.reusable_prefix(ids, 100, 64) == 37


class _CausalSdpa(torch.nn.Module):
    """A core attention in Megatron's layout: q `[s, b, nh, d]`, k/v `[s, b, ng, d]` -> `[s, b, nh * d]`."""

    def forward(self, q, k, v, attention_mask=None, *args, **kwargs):
        s, b, nh, d = q.shape
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                             scale=D ** -0.5, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * d)


def test_decode_steps_through_the_cache_are_attention_over_the_sequence(cpu_parallel_state):
    """Prefill, decode steps of one and two tokens, and steps that roll back a draft (into the decoded tokens and
    into the prefill) through the real ContextParallelKVCache at CP 1: each step's output is SDPA of its queries over
    the sequence as it stands (causal among the new tokens), so rolled-back keys are not seen. The model is a shell
    holding one core attention (the cache reads only its layers, rotary embedding and config)."""
    from types import SimpleNamespace

    from megatron_ext.evaluate.kv_cache import ContextParallelKVCache

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(12, 1, h, D, generator=g) for h in (NH, NG, NG))
    layer = SimpleNamespace(self_attention=SimpleNamespace(core_attention=_CausalSdpa()))
    model = SimpleNamespace(rotary_pos_emb=SimpleNamespace(positions=None), decoder=SimpleNamespace(layers=[layer]),
                            config=SimpleNamespace(kv_channels=D, softmax_scale=D ** -0.5))
    cache = ContextParallelKVCache(model)
    attn = layer.self_attention.core_attention
    seq = {"k": [], "v": []}  # the sequence's keys and values as they stand

    def step(start: int, nq: torch.Tensor, nk: torch.Tensor, nv: torch.Tensor) -> None:
        del seq["k"][start:], seq["v"][start:]
        seq["k"] += list(nk)
        seq["v"] += list(nv)
        with cache.decoding(start, len(nq)):
            got = attn(nq, nk, nv)
        keys, values = torch.stack(seq["k"]), torch.stack(seq["v"])
        visible = torch.arange(len(keys))[None, :] <= torch.arange(start, start + len(nq))[:, None]
        want = F.scaled_dot_product_attention(nq.permute(1, 2, 0, 3), keys.permute(1, 2, 0, 3),
                                              values.permute(1, 2, 0, 3), attn_mask=visible, scale=D ** -0.5,
                                              enable_gqa=True)
        torch.testing.assert_close(got, want.permute(2, 0, 1, 3).reshape(len(nq), 1, NH * D), atol=1e-5, rtol=1e-5)

    with cache.recording(torch.arange(8), 8):
        attn(q[:8], k[:8], v[:8])
    seq["k"], seq["v"] = list(k[:8]), list(v[:8])
    step(8, q[8:10], k[8:10], v[8:10])  # two new tokens: causal among them
    step(10, q[10:11], k[10:11], v[10:11])
    step(9, q[11:12], k[11:12], v[11:12])  # a draft at 9, 10 rolled back: another token at 9
    step(6, q[9:11], k[9:11], v[9:11])  # back into the prefill: its rows 6 and 7 are dropped
