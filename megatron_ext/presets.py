"""Model architecture presets, as Hugging Face Llama `config.json` fields (transformers-4 form).

Pure data, importable without torch, so that recipe checks stay fast on a login node.
"""

from __future__ import annotations

# Exact shapes of meta-llama/Llama-3.1-8B(-Instruct) (config.json of the release).
LLAMA31_8B: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

# A Llama-3.1-shaped model small enough for 2 CPU cores: GQA (4 heads, 2 KV heads), SwiGLU,
# RMSNorm, llama3-type RoPE at a short original context.
TINY: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}

# The `make demo` model: Llama-3.1-shaped (GQA, SwiGLU, llama3-type RoPE over an original context of 256 with
# Llama-3.1's factor 8 and low/high frequency factors 1/4), small enough to learn needle retrieval on 2 CPU cores
# in minutes. Trained at 256 tokens it stands in for Llama-3.1-8B-Instruct at 128K; the demo extends it 8x
# (2048 tokens) by YaRN CPT as the paper extends 128K to 1M. Vocabulary: the demo tokenizer (< 640 tokens).
TINY_DEMO: dict = {
    **TINY,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 640,
    "max_position_embeddings": 256,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 256},
}

# transformers' LlamaConfig default, what a config.json without `rms_norm_eps` means (Llama-3's state 1e-5): the
# converter and a recipe's `model.hf_config` read such a file alike
HF_LLAMA_RMS_NORM_EPS = 1e-6

PRESETS: dict[str, dict] = {"llama3.1-8b": LLAMA31_8B, "tiny": TINY, "tiny-demo": TINY_DEMO}


def _ultralong_rope(factor: int) -> dict:
    return {"rope_type": "yarn", "rope_theta": 500000.0, "factor": float(factor),
            "original_max_position_embeddings": 8192, "beta_fast": 4.0, "beta_slow": 1.0}


# RoPE blocks (HF transformers-5 `rope_parameters` form) of UltraLong-8B 1M / 2M / 4M: YaRN on Llama-3.1's
# theta and 8192 original positions, factor = target length / 8192, beta_fast 4 / beta_slow 1 (paper's
# beta = 4, alpha = 1); attention factor left to the HF default 0.1 ln(factor) + 1. Recipes: `rope: {preset: ...}`.
# From the paper's text: the released models' config.json rope blocks were not found (UNCONFIRMED; recipes/README.md).
ROPE_PRESETS: dict[str, dict] = {"ultralong-1m": _ultralong_rope(128), "ultralong-2m": _ultralong_rope(256),
                                 "ultralong-4m": _ultralong_rope(512)}
