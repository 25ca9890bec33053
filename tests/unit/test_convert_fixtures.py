"""Tiny random HF Llama-3.1 models saved with transformers, for converter tests (helpers, no tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_ext.presets import TINY

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 4.0,
        "beta_slow": 1.0}
VARIANTS = {
    # name: config overrides (TINY is GQA 2:1 with llama3 rope)
    "llama3-gqa2": {},
    "default-gqa4": {"num_key_value_heads": 1, "rope_scaling": None},
    "linear-mha": {"num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "tied-padded-vocab": {"tie_word_embeddings": True, "vocab_size": 500, "rope_scaling": None},
    "yarn-gqa2": {"rope_scaling": YARN, "rope_theta": 500000.0},
    # 32 positions: the tests' 48 tokens take dynamic's scaled branch (at 256 it would be plain RoPE)
    "dynamic-gqa2": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 32},
    "longrope-gqa2": {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                                       "short_factor": [1.0 + i / 8 for i in range(8)],
                                       "long_factor": [2.0 + i / 4 for i in range(8)]}},
}


def make_hf_model(out: Path, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """Save a random LlamaForCausalLM (fp32) built from TINY + overrides; returns `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(TINY, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    with torch.no_grad():  # norms are ones at init; make them random so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(out))
    if tokenizer:  # a stand-in tokenizer (a vocabulary and its settings): the converter copies them verbatim
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>")).save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return out


def rope_fields(cfg: dict) -> dict:
    from megatron_ext.hf_config import normalize_hf_config

    n = normalize_hf_config(cfg)
    return {"rope_theta": n["rope_theta"], "rope_scaling": n["rope_scaling"]}
