"""Pins of `megatron_ext.rope_spec` found by a hand mutation audit (round 6): edges of the rope validator that the
broader rope tests left open. The oracle is transformers' `modeling_rope_utils` (ROPE_INIT_FUNCTIONS): what it
computes for a block, and where it divides by zero or builds a tensor of odd width."""

import pytest

from megatron_ext.rope_spec import RopeConfigError, rope_spec

SIZES = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 131072}  # head_dim 64


def spec(block, **top):
    return rope_spec({**SIZES, "rope_parameters": {"rope_theta": 10000.0, **block}, **top})


def refused(block, fragment, **top):
    with pytest.raises(RopeConfigError) as e:
        spec(block, **top)
    assert fragment in str(e.value), str(e.value)


def test_rotated_channels_truncate_as_transformers():
    """transformers: dim = int(head_dim * partial_rotary_factor); 64 x 0.7 = 44.8 rotates 44 channels (rounding
    would give 45, an odd width refused below), and an odd truncation (64 x 0.3 = 19) has no cos/sin pairs."""
    assert spec({"partial_rotary_factor": 0.7}).dim == 44
    refused({"partial_rotary_factor": 0.3}, "= 19 rotated channels: must be even")


def test_strict_minimums_refuse_the_minimum_itself():
    """rope_theta 0 makes every inverse frequency 1/0**x (inf / nan angles); attention_factor 0 zeroes cos and sin."""
    refused({"rope_theta": 0}, "rope_parameters.rope_theta = 0: must be > 0")
    refused({"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.0}, "attention_factor = 0.0: must be > 0")


def test_a_bool_is_not_a_number():
    """YAML/JSON `true` is an int subclass in Python: factor: true would pass `>= 1` as 1."""
    refused({"rope_type": "linear", "factor": True}, "rope_parameters.factor = True: must be a number")


def test_max_position_embeddings_must_be_positive():
    refused({}, "config.max_position_embeddings = 0: must be >= 1", max_position_embeddings=0)


def test_dynamic_needs_more_than_two_rotated_channels():
    """transformers' dynamic NTK raises the base to dim / (dim - 2): a division by zero at 2 channels."""
    with pytest.raises(RopeConfigError) as e:
        rope_spec({"head_dim": 2, "max_position_embeddings": 4096,
                   "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}})
    assert "dynamic rope needs more than 2 rotated channels, got 2" in str(e.value)


def test_yarn_beta_fast_defaults_to_32():
    """transformers' yarn: beta_fast defaults to 32 and beta_slow to 1, so beta_slow 8 alone is valid, 40 is not."""
    assert spec({"rope_type": "yarn", "factor": 8.0, "beta_slow": 8.0}).get("beta_fast") is None
    refused({"rope_type": "yarn", "factor": 8.0, "beta_slow": 40.0}, "beta_fast = 32: must be above beta_slow = 40.0")


def test_llama3_equal_frequency_factors_are_refused():
    """transformers' llama3 smooths by (wavelen ratio - low) / (high - low): equal factors divide by zero."""
    refused({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 2.0,
             "high_freq_factor": 2.0}, "high_freq_factor = 2.0: must be above low_freq_factor = 2.0")


def test_top_level_fields_are_named_at_the_top():
    """A bad top-level rope_theta (transformers-4 form) or a missing head_dim is named as `<top>.field`, not as a
    field of the rope block the user never wrote it in."""
    with pytest.raises(RopeConfigError) as e:
        rope_spec({**SIZES, "rope_theta": -1.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert str(e.value).startswith("config.rope_theta = -1.0"), str(e.value)
    with pytest.raises(RopeConfigError) as e:
        rope_spec({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, where="rope", top="model")
    assert str(e.value).startswith("model.head_dim: missing"), str(e.value)


def test_longrope_factors_must_be_positive():
    """longrope divides each inverse frequency by its factor: a 0 or negative entry gives inf or flipped angles."""
    ok = [1.0] * 32
    assert spec({"rope_type": "longrope", "short_factor": ok, "long_factor": ok,
                 "original_max_position_embeddings": 4096}).get("factor") == 32.0  # 131072 / 4096, as transformers
    refused({"rope_type": "longrope", "short_factor": ok, "long_factor": ok[:-1] + [0.0],
             "original_max_position_embeddings": 4096}, "rope_parameters.long_factor = 0.0: must be > 0")
