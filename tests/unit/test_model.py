"""Model builder and megatron_ext.hf_config: HF config <-> TransformerConfig, vocab padding, a tiny GPTModel runs on CPU."""

import pytest
import torch

from megatron_ext.hf_config import hf_config_from_recipe, normalize_hf_config
from megatron_ext.model import BuildOptions, build_model, padded_vocab_size, transformer_config
from megatron_ext.presets import LLAMA31_8B, TINY
from megatron_ext.recipe import load_recipe


@pytest.mark.parametrize("vocab, tp, expected", [(128256, 1, 128256), (128256, 2, 128256), (128256, 4, 128256),
                                                 (128256, 8, 128256), (500, 1, 512), (512, 1, 512)])
def test_padded_vocab_size(vocab, tp, expected):
    assert padded_vocab_size(vocab, 128, tp) == expected


def test_padding_disabled():
    assert padded_vocab_size(500, 1, 1) == 500


def test_llama31_8b_transformer_config_matches_hf_shapes():
    c = transformer_config(LLAMA31_8B, BuildOptions(device="cpu", attention="sdpa"))
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size) == (32, 4096, 14336)
    assert (c.num_attention_heads, c.num_query_groups, c.kv_channels) == (32, 8, 128)
    assert c.normalization == "RMSNorm" and c.gated_linear_unit and not c.add_bias_linear
    assert c.layernorm_epsilon == 1e-5 and c.calculate_per_token_loss


def test_normalize_transformers5_form():
    cfg = {k: v for k, v in TINY.items() if k not in ("rope_theta", "rope_scaling", "head_dim")}
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}
    n = normalize_hf_config(cfg)
    assert n["rope_theta"] == 5e5 and n["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0}
    assert n["head_dim"] == 16


def test_recipe_to_hf_config_roundtrip_of_rope():
    r = load_recipe(raw={"model": {"preset": "llama3.1-8b"}, "train": {"seq_length": 8192, "steps": 1, "lr": 1e-5},
                         "cluster": {"gpus_per_node": 1}})
    cfg = hf_config_from_recipe(r)
    assert cfg["rope_scaling"] == LLAMA31_8B["rope_scaling"] and cfg["rope_theta"] == 500000.0
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert cfg[key] == LLAMA31_8B[key]


def test_tiny_model_forward_backward_on_cpu(cpu_parallel_state):
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=64))
    tokens = torch.randint(0, 512, (2, 64))
    loss = model(tokens, torch.arange(64).expand(2, 64), None, labels=torch.roll(tokens, -1, 1))
    assert loss.shape == (2, 64)
    assert 5.5 < loss.mean().item() < 7.0  # about ln(512) = 6.24 at init
    loss.mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and all(torch.isfinite(g).all() for g in grads)
    assert model.embedding.word_embeddings.weight.shape == (512, 64)


def test_padding_is_tp_portable_but_divides_tp():
    for tp in (1, 2, 3, 4, 8, 16):
        rows = padded_vocab_size(128256, 128, tp)
        assert rows % tp == 0 and rows % 128 == 0 and rows >= 128256
        if 128 % tp == 0:
            assert rows == 128256  # the same checkpoint rows at every power-of-two TP


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_every_parameter_in_the_precision(cpu_parallel_state, precision, dtype):
    """The local spec's torch RMSNorms included (created in fp32 by Megatron; cast as Megatron-LM's Float16Module does),
    so bf16 activations meet bf16 weights and torch's fused RMSNorm applies."""
    model = build_model(TINY, BuildOptions(device="cpu", precision=precision, seq_length=64))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * TINY["num_hidden_layers"] + 1
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.config.pipeline_dtype == dtype  # the dtype of the activations PP stages exchange


@pytest.mark.parametrize("std", [0.02, 0.2])
def test_initializer_range_is_the_init_std(cpu_parallel_state, std):
    """HF's initializer_range is Megatron's init_method_std: the normal init of the QKV weights (8192 draws, so the
    sample std is within 3%). Pins mutant: init_method_std fixed at 0.02."""
    torch.manual_seed(0)
    model = build_model({**TINY, "initializer_range": std}, BuildOptions(device="cpu", seq_length=32))
    weight = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert weight.numel() == 8192 and weight.std().item() == pytest.approx(std, rel=0.03)


@pytest.mark.parametrize("opts, message", [
    (BuildOptions(loss_chunk_tokens=0), r"train.loss_chunk_tokens = 0: must be >= 1"),
    (BuildOptions(loss_head="fused"), r"train.loss_head = 'fused': expected 'chunked' or 'full'"),
])
def test_loss_head_options_are_checked_at_build(cpu_parallel_state, opts, message):
    """build_model is called without a recipe too (evaluation, conversion): a chunk of 0 tokens is refused there.
    Pins mutant: the bound at < 0."""
    from megatron_ext.recipe import RecipeError

    with pytest.raises(RecipeError, match=message):
        build_model(TINY, opts)
