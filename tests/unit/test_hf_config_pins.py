"""Pins of `megatron_ext.hf_config` against transformers' own reading of the same config (mutation audit): the
normalised (transformers-4) form must mean to LlamaConfig what the form it came from means, and keep the v4 shape
(`rope_theta` / `partial_rotary_factor` beside `rope_scaling`, which holds `rope_type`, never the old `type`)."""

from __future__ import annotations

import copy
import logging

import pytest

from megatron_ext.hf_config import hf_config_from_recipe, normalize_hf_config
from megatron_ext.recipe import load_recipe

SIZES = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 512, "max_position_embeddings": 256}

CASES = {
    # transformers-5 form: theta and the rotary fraction inside rope_parameters; GQA without head_dim
    "v5-yarn-partial": {**SIZES, "num_key_value_heads": 2,
                        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5,
                                            "partial_rotary_factor": 0.5, "original_max_position_embeddings": 32}},
    "v5-default": {**SIZES, "rope_parameters": {"rope_type": "default", "rope_theta": 2e5}},
    # a key the type does not read stays: transformers keeps it (and warns), so the converter's checks see it
    "v5-default-extra": {**SIZES, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}},
    "v4-default-extra": {**SIZES, "rope_theta": 1e4, "rope_scaling": {"rope_type": "default", "factor": 2.0}},
    "v4-old-type": {**SIZES, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
    # both keys: transformers goes by rope_type
    "v4-both-types": {**SIZES, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "rope_type": "dynamic",
                                                                   "factor": 2.0}},
    # nothing about rope, KV heads null, no eps / tying: every default is transformers'
    "bare": {**SIZES, "num_key_value_heads": None},
}


def _hf(cfg: dict):
    from transformers import LlamaConfig

    logging.getLogger("transformers").setLevel(logging.ERROR)  # "unrecognized keys" of the -extra cases
    return LlamaConfig(**copy.deepcopy(cfg))


def _rope(hf) -> dict:
    return {k: v for k, v in hf.rope_parameters.items() if k != "type"}  # transformers leaves the old key in


@pytest.mark.parametrize("name", sorted(CASES))
def test_normalized_config_means_to_transformers_what_the_original_does(name):
    """Kills: theta / rotary fraction left inside rope_scaling or dropped; `type` winning over `rope_type` or left in;
    a default block with fields dropped; wrong default theta, KV heads, head_dim, eps or tying."""
    cfg = CASES[name]
    n = normalize_hf_config(cfg)
    want, got = _hf(cfg), _hf(n)
    assert _rope(got) == _rope(want)
    assert n["rope_theta"] == want.rope_parameters["rope_theta"]
    # the model takes rotary_percent from the top-level key (megatron_ext.model)
    assert n.get("partial_rotary_factor", 1.0) == want.rope_parameters.get("partial_rotary_factor", 1.0)
    for key in ("num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings"):
        assert n[key] == getattr(want, key), key
    scaling = n["rope_scaling"]
    assert scaling is None or ("rope_type" in scaling and not {"type", "rope_theta", "partial_rotary_factor"} & set(scaling))
    assert "rope_parameters" not in n and cfg == CASES[name]  # the input is left alone


def test_recipe_without_kv_heads_is_multi_head_attention():
    """model.num_key_value_heads unset means one KV head per head (the recipe's doc, transformers' default): the
    config the checkpoint records and the export ships says so."""
    model = {k: v for k, v in SIZES.items() if k != "max_position_embeddings"}
    r = load_recipe(raw={"model": model, "train": {"seq_length": 64, "steps": 1, "lr": 1e-5},
                         "cluster": {"gpus_per_node": 1}, "runtime": {"device": "cpu"}})
    assert r.model.num_key_value_heads is None
    cfg = hf_config_from_recipe(r)
    want = _hf({**SIZES, "num_key_value_heads": None})
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (want.num_key_value_heads, want.head_dim) == (4, 16)
