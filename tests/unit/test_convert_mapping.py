"""The mapping table and its pure transforms (no model, no files)."""

import pytest
import torch

from megatron_ext.convert import mapping
from megatron_ext.hf_config import normalize_hf_config
from megatron_ext.presets import LLAMA31_8B, TINY


@pytest.mark.parametrize("heads, groups", [(4, 1), (4, 2), (4, 4), (32, 8)])
def test_qkv_layout_is_grouped_per_kv_head(heads, groups):
    d, hidden = 3, 5
    # each row says which head and projection it belongs to: q head h -> 100+h, k group g -> 200+g, v -> 300+g
    q = torch.cat([torch.full((d, hidden), 100.0 + h) for h in range(heads)])
    k = torch.cat([torch.full((d, hidden), 200.0 + g) for g in range(groups)])
    v = torch.cat([torch.full((d, hidden), 300.0 + g) for g in range(groups)])
    qkv = mapping.merge_qkv(q, k, v, heads, groups)
    per = heads // groups
    expected = []
    for g in range(groups):
        expected += [100 + g * per + i for i in range(per)] + [200 + g, 300 + g]
    assert qkv[::d, 0].tolist() == expected
    assert all(torch.equal(a, b) for a, b in zip(mapping.split_qkv(qkv, heads, groups), (q, k, v)))


def test_gate_up_and_vocab_round_trip():
    cfg = normalize_hf_config(dict(TINY, vocab_size=500))
    gate, up = torch.randn(176, 64), torch.randn(176, 64)
    fc1_entry = mapping.entry_for_key("decoder.layers.mlp.linear_fc1.weight")
    fc1 = mapping.to_megatron(fc1_entry, [gate, up], cfg, 512)
    assert torch.equal(fc1[:176], gate) and torch.equal(fc1[176:], up)  # silu(first half) * second half
    assert all(torch.equal(a, b) for a, b in zip(mapping.to_hf(fc1_entry, fc1, cfg), (gate, up)))
    emb = torch.randn(500, 64)
    e = mapping.entry_for_key("embedding.word_embeddings.weight")
    padded = mapping.to_megatron(e, [emb], cfg, 512)
    assert padded.shape == (512, 64) and torch.equal(padded[:500], emb) and not padded[500:].any()
    stripped = mapping.to_hf(e, padded, cfg)[0]
    assert torch.equal(stripped, emb)


def test_table_covers_every_llama_tensor_once():
    for tied in (False, True):
        cfg = normalize_hf_config(dict(LLAMA31_8B, tie_word_embeddings=tied))
        names = mapping.expected_hf_names(cfg)
        assert len(names) == len(set(names)) == 9 * 32 + 2 + (0 if tied else 1)
        assert ("lm_head.weight" in names) == (not tied)
        shapes = mapping.hf_shapes(cfg)
        assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    keys = [e.megatron for e in mapping.TABLE]
    assert len(keys) == len(set(keys))
    # both layer specs' norm module names are listed for the fused-norm checkpoint keys
    assert set(mapping.MODULE_NAMES["local"]) == set(mapping.MODULE_NAMES["te"])
