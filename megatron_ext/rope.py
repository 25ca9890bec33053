"""Scaled RoPE for Megatron-Core (foundation version: default, linear and llama3 types).

The full module (yarn, dynamic, longrope, attention factor, CP-local tables) is issue #3.
"""

from __future__ import annotations

import math

import torch

from megatron_ext.model import normalize_hf_config


def _rope_params(hf_config: dict) -> tuple[float, dict, int]:
    cfg = normalize_hf_config(hf_config)
    dim = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
    return float(cfg["rope_theta"]), dict(cfg.get("rope_scaling") or {"rope_type": "default"}), dim


def rope_frequencies(hf_config: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq `[dim/2]` fp32, attention_factor) for an HF Llama config."""
    theta, scaling, dim = _rope_params(hf_config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise NotImplementedError(f"rope_type {kind!r} is not implemented yet (issue #3)")


def attach_rotary_embedding(model, hf_config: dict) -> None:
    """Make `model.rotary_pos_emb` (a Megatron `RotaryEmbedding`) use our frequencies."""
    if getattr(model, "rotary_pos_emb", None) is None:
        return
    inv_freq, attention_factor = rope_frequencies(hf_config)
    if attention_factor != 1.0:
        raise NotImplementedError("RoPE attention factor is not wired yet (issue #3)")
    model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
