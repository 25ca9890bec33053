"""Pins of the model presets (megatron_ext.presets) from the mutation audit (round 7), each against a fact the
numbers must agree with rather than the numbers restated: transformers' own LlamaConfig default, the context length
a RoPE preset is named for, and the relations within Llama-3.1-8B's release config."""

import pytest

from megatron_ext.presets import HF_LLAMA_RMS_NORM_EPS, LLAMA31_8B, ROPE_PRESETS


def test_the_rms_norm_eps_default_is_transformers_own():
    """A config.json without rms_norm_eps means what transformers' LlamaConfig makes of it (PS8)."""
    transformers = pytest.importorskip("transformers")
    assert HF_LLAMA_RMS_NORM_EPS == transformers.LlamaConfig().rms_norm_eps


@pytest.mark.parametrize("name, tokens", [("ultralong-1m", 1 << 20), ("ultralong-2m", 1 << 21),
                                          ("ultralong-4m", 1 << 22)])
def test_ultralong_presets_reach_the_length_they_are_named_for(name, tokens):
    """YaRN over Llama-3.1-8B's own RoPE (its theta and its 8192 original positions) scaled by the factor that
    makes those positions the preset's length: 2^20 for 1M, and so on (PS9, PS11, PS12, PS18); beta_fast above
    beta_slow (YaRN's ramp runs from the fast to the slow dimensions: PS10)."""
    rope = ROPE_PRESETS[name]
    original = LLAMA31_8B["rope_scaling"]["original_max_position_embeddings"]
    assert rope["rope_type"] == "yarn" and rope["rope_theta"] == LLAMA31_8B["rope_theta"]
    assert rope["original_max_position_embeddings"] == original and rope["factor"] * original == tokens
    assert rope["beta_fast"] > rope["beta_slow"]


def test_llama31_8b_fields_agree_with_each_other():
    """The release's 128K context, 128 x 1024 positions (PS15; not factor x original: llama3 scaling is no
    plain stretch); head_dim = hidden / heads (PS16); the Instruct
    model's turn end <|eot_id|> (128009) among the eos ids, or generation runs past a reply (PS5); bos is
    <|begin_of_text|>, the first special token after the 128,000 BPE tokens (PS13)."""
    assert LLAMA31_8B["max_position_embeddings"] == 128 * 1024
    assert LLAMA31_8B["head_dim"] * LLAMA31_8B["num_attention_heads"] == LLAMA31_8B["hidden_size"]
    assert 128009 in LLAMA31_8B["eos_token_id"] and LLAMA31_8B["bos_token_id"] == 128000


def test_the_demo_tokenizer_fits_the_tiny_demo_vocabulary(tmp_path):
    """`make demo` trains its BPE tokenizer (624 tokens) and refuses a tokenizer larger than the tiny-demo model's
    vocabulary: the preset must hold every id (PS17: 512 stopped the demo at its start)."""
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from megatron_ext.demo.corpus import build_demo_tokenizer
    from megatron_ext.presets import TINY_DEMO

    tokens = len(AutoTokenizer.from_pretrained(str(build_demo_tokenizer(tmp_path / "tok"))))
    assert 512 < tokens <= TINY_DEMO["vocab_size"], tokens
