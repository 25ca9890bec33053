"""SFT packing: a packed (THD) batch gives the same per-token losses as each sample run alone."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY

YARN = {**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "beta_fast": 4.0, "beta_slow": 1.0}}


def packed_params(lengths):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


@pytest.mark.parametrize("hf_cfg", [TINY, YARN], ids=["llama3", "yarn"])
def test_packed_equals_one_by_one(cpu_parallel_state, hf_cfg):
    torch.manual_seed(0)
    model = build_model(hf_cfg, BuildOptions(device="cpu", seq_length=256)).eval()
    lengths = [50, 90, 30]
    samples = [torch.randint(3, 512, (n,)) for n in lengths]
    with torch.no_grad():
        alone = [model(s[None], torch.arange(len(s))[None], None, labels=torch.roll(s, -1)[None])[0]
                 for s in samples]
        tokens = torch.cat(samples)[None]
        labels = torch.cat([torch.roll(s, -1) for s in samples])[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        packed = model(tokens, positions, None, labels=labels, packed_seq_params=packed_params(lengths))[0]
        # Negative control: the same tokens as one sequence (attention crosses samples, positions run on).
        crossing = model(tokens, torch.arange(tokens.shape[1])[None], None, labels=labels)[0]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)
    assert (crossing[lengths[0]:] - torch.cat(alone)[lengths[0]:]).abs().max() > 1e-3


def test_sample_bounds_are_read_once_per_cu_tensor():
    """Every layer of a microbatch gets the same cu_seqlens tensor: read once; the next microbatch's (another
    tensor, other bounds) is read again, not taken from the last."""
    from megatron_ext.attention import _sample_bounds

    first = packed_params([50, 90, 30]).cu_seqlens_q
    assert _sample_bounds(first) == [0, 50, 140, 170]
    first[1] = 7  # not read again: the values come from the first call
    assert _sample_bounds(first) == [0, 50, 140, 170]
    assert _sample_bounds(packed_params([20, 10]).cu_seqlens_q) == [0, 20, 30]


def test_mask_kinds_the_sdpa_backend_cannot_run_are_refused(cpu_parallel_state):
    """padding_causal (TE's name for causal over packed sequences) ran as no mask at all: bidirectional attention."""
    from megatron.core.transformer.enums import AttnMaskType

    model = build_model(TINY, BuildOptions(device="cpu", seq_length=64)).eval()
    attention = model.decoder.layers[0].self_attention.core_attention
    q = torch.randn(16, 1, 4, 16)
    kv = torch.randn(16, 1, 2, 16)
    causal = attention(q, kv, kv, attn_mask_type=AttnMaskType.causal)
    torch.testing.assert_close(attention(q, kv, kv, attn_mask_type=AttnMaskType.padding_causal), causal)
    assert (attention(q, kv, kv, attn_mask_type=AttnMaskType.no_mask) - causal).abs().max() > 1e-3
    for kind in (AttnMaskType.causal_bottom_right, AttnMaskType.arbitrary, AttnMaskType.padding):
        with pytest.raises(NotImplementedError, match=f"attn_mask_type {kind.name}"):
            attention(q, kv, kv, attn_mask_type=kind)
    with pytest.raises(NotImplementedError, match="with an attention_mask tensor"):
        attention(q, kv, kv, attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool))


def test_packed_core_attention_follows_padded_bounds_and_the_mask_kind():
    """THD core attention against SDPA over each sample alone (the oracle): samples start at cu_seqlens_q_padded where
    it is given (Megatron's layout when samples are padded, the pads after each sample's tokens), and a no_mask
    layer attends both ways within each sample. Pins mutants: cu_seqlens_q read in place of the padded bounds;
    packed attention always causal."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.attention import TorchSDPAttention
    from megatron_ext.model import transformer_config

    config = transformer_config(TINY, BuildOptions(device="cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, heads, 16, generator=gen) for heads in (4, 2, 2))

    def alone(start, end, causal):
        out = F.scaled_dot_product_attention(*(t[start:end].transpose(0, 1)[None] for t in (q, k, v)),
                                             is_causal=causal, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(end - start, -1)

    # samples of 5 and 7 tokens, each padded to 8: rows 5-7 and 15 are padding
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, 5, 12], dtype=torch.int32),
                             cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
                             cu_seqlens_kv_padded=torch.tensor([0, 8, 16], dtype=torch.int32), max_seqlen_q=8,
                             max_seqlen_kv=8)
    out = TorchSDPAttention(config, 1, AttnMaskType.padding_causal, "self")(q, k, v, packed_seq_params=padded)
    assert out.shape == (16, 4 * 16)
    torch.testing.assert_close(out[0:5], alone(0, 5, True))
    torch.testing.assert_close(out[8:15], alone(8, 15, True))

    unmasked = TorchSDPAttention(config, 1, AttnMaskType.no_mask, "self")(q, k, v,
                                                                          packed_seq_params=packed_params([6, 10]))
    torch.testing.assert_close(unmasked, torch.cat([alone(0, 6, False), alone(6, 16, False)]))
    assert (unmasked - torch.cat([alone(0, 6, True), alone(6, 16, True)])).abs().max() > 1e-3  # control
