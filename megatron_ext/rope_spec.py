"""Rope block of an HF config: parse, apply transformers' defaults, validate (pure Python, no torch).

Accepts the transformers-4 form (`rope_theta` + `rope_scaling`, also the old `type` key) and the
transformers-5 form (`rope_parameters`). Recipe checks use it at load time, before any process
group or allocation; `megatron_ext.rope` computes frequencies and tables from the `RopeSpec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ext.presets import ROPE_PRESETS
from megatron_ext.recipe import RecipeError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# How the trainer forms each angle, position x frequency: "float64" (exact, reduced mod 2 pi before rounding) or
# "float32" (the product transformers, vLLM and stock Megatron-Core form). A top-level HF config key of our own,
# written only when float32; absent, float64. See megatron_ext/rope_angles.py.
ANGLE_PRECISIONS = ("float64", "float32")
ANGLE_PRECISION_KEY = "rope_angle_precision"
# Fields each rope type reads (besides rope_type / rope_theta / partial_rotary_factor), as transformers.
ROPE_FIELDS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
    "longrope": {"factor", "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}


# HF rope blocks (transformers-5 `rope_parameters` form) of the UltraLong 1M / 2M / 4M models.
ULTRALONG_ROPE: dict[str, dict] = ROPE_PRESETS


class RopeConfigError(RecipeError):
    """A bad rope block in an HF config: the message names the field, the value and the fix."""


@dataclass(frozen=True)
class RopeSpec:
    """A validated rope block. `params` has HF names; `where` is the block's key for messages."""

    rope_type: str
    theta: float
    head_dim: int
    partial_rotary_factor: float
    dim: int  # rotated channels = int(head_dim * partial_rotary_factor)
    params: dict
    max_position_embeddings: int | None
    where: str
    angle_precision: str = "float64"  # position x frequency formed in float64 (exact) or float32 (as served)

    def get(self, key: str, default=None):
        return self.params.get(key, default)


def _number(where: str, key: str, value, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RopeConfigError(f"{where}.{key} = {value!r}: must be a number")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise RopeConfigError(f"{where}.{key} = {value!r}: must be {'>' if strict else '>='} {minimum}")
    return value


def _rope_block(cfg: dict) -> tuple[dict, str]:
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for name, block in (("rope_scaling", scaling), ("rope_parameters", params)):
        if block is not None and not isinstance(block, dict):
            raise RopeConfigError(f"{name} = {block!r}: must be a mapping (e.g. {{rope_type: yarn, factor: 128}})")
    if scaling and params:
        clash = sorted(k for k in set(scaling) & set(params) if scaling[k] != params[k])
        if clash:
            raise RopeConfigError(f"rope_scaling and rope_parameters disagree on {clash}; keep one of the two blocks")
        return {**params, **scaling}, "rope_scaling"
    if scaling:
        return dict(scaling), "rope_scaling"
    return dict(params or {}), "rope_parameters"


def rope_spec(hf_config: dict, *, where: str | None = None, top: str = "config") -> RopeSpec:
    """Parse and validate the rope block of an HF config (either form), with transformers' defaults.

    Errors name fields as `<block>.field` (`rope_scaling` / `rope_parameters`, or `where` if given)
    and `<top>.field` for top-level fields (recipes pass where="rope", top="model").
    """
    block, found = _rope_block(hf_config)
    where = where or found
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise RopeConfigError(f"{where}.rope_type = {rope_type!r}: unknown; use one of {list(ROPE_TYPES)}")
    unknown = sorted(set(block) - _COMMON_KEYS - ROPE_FIELDS[rope_type])
    if unknown:
        raise RopeConfigError(f"{where}.{unknown[0]}: not a field of rope_type {rope_type!r} "
                              f"(its fields: {sorted(ROPE_FIELDS[rope_type])}); remove it or change rope_type")
    theta = block.get("rope_theta")
    theta = hf_config.get("rope_theta", 10000.0) if theta is None else theta
    theta = float(_number(where if "rope_theta" in block else top, "rope_theta", theta, minimum=0, strict=True))
    prf = block.get("partial_rotary_factor")
    prf = hf_config.get("partial_rotary_factor", 1.0) if prf is None else prf
    prf_where = where if "partial_rotary_factor" in block else top
    prf = _number(prf_where, "partial_rotary_factor", prf, minimum=0, strict=True)
    if prf > 1:
        raise RopeConfigError(f"{prf_where}.partial_rotary_factor = {prf}: must be in (0, 1]")
    head_dim = hf_config.get("head_dim")
    if head_dim is None:
        if not hf_config.get("hidden_size") or not hf_config.get("num_attention_heads"):
            raise RopeConfigError(f"{top}.head_dim: missing, and no hidden_size / num_attention_heads to derive it")
        head_dim = hf_config["hidden_size"] // hf_config["num_attention_heads"]
    dim = int(head_dim * prf)
    if dim < 2 or dim % 2:
        raise RopeConfigError(f"{top}.head_dim x partial_rotary_factor = {head_dim} x {prf} = {dim} rotated "
                              "channels: must be even and >= 2")
    max_pos = hf_config.get("max_position_embeddings")
    if max_pos is not None:
        max_pos = int(_number(top, "max_position_embeddings", max_pos, minimum=1))
    params = {k: v for k, v in block.items() if k not in _COMMON_KEYS}

    if "factor" in ROPE_FIELDS[rope_type] and rope_type != "longrope" and params.get("factor") is None:
        raise RopeConfigError(f"{where}.factor: missing; rope_type {rope_type!r} needs a scaling factor >= 1 "
                              "(e.g. 128 for UltraLong 1M = 1048576 / 8192)")
    if "original_max_position_embeddings" in ROPE_FIELDS[rope_type]:
        # transformers: a top-level `original_max_position_embeddings` wins; else max_position_embeddings
        orig = hf_config.get("original_max_position_embeddings")
        orig = params.get("original_max_position_embeddings") if orig is None else orig
        orig = max_pos if orig is None else orig
        if orig is None:
            raise RopeConfigError(f"{where}.original_max_position_embeddings: missing (and no max_position_embeddings);"
                                  f" rope_type {rope_type!r} needs the pre-scaling context length, e.g. 8192")
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise RopeConfigError(f"{where}.original_max_position_embeddings = {orig!r}: must be a positive integer")
        if max_pos is not None and orig > max_pos:
            raise RopeConfigError(f"{where}.original_max_position_embeddings = {orig}: above max_position_embeddings ="
                                  f" {max_pos}; the original length must not exceed the (scaled) model length")
        params["original_max_position_embeddings"] = orig
    if params.get("factor") is not None:
        _number(where, "factor", params["factor"], minimum=1)
    if rope_type == "dynamic" and max_pos is None:
        raise RopeConfigError(f"{top}.max_position_embeddings: missing; rope_type 'dynamic' scales relative to it")
    if rope_type == "dynamic" and dim <= 2:
        raise RopeConfigError(f"{top}.head_dim: dynamic rope needs more than 2 rotated channels, got {dim}")
    if rope_type == "yarn":
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                _number(where, key, params[key])
        fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1  # transformers' defaults
        if fast <= slow:
            raise RopeConfigError(f"{where}.beta_fast = {fast}: must be above beta_slow = {slow} "
                                  "(UltraLong: beta_fast 4, beta_slow 1)")
    if params.get("attention_factor") is not None:
        _number(where, "attention_factor", params["attention_factor"], minimum=0, strict=True)
    if rope_type == "llama3":
        low = _number(where, "low_freq_factor", params.get("low_freq_factor"), minimum=0, strict=True)
        high = _number(where, "high_freq_factor", params.get("high_freq_factor"), minimum=0, strict=True)
        if high <= low:
            raise RopeConfigError(f"{where}.high_freq_factor = {high}: must be above low_freq_factor = {low}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            value = params.get(key)
            if not isinstance(value, (list, tuple)) or len(value) != dim // 2:
                raise RopeConfigError(f"{where}.{key}: must be a list of {dim // 2} numbers (rotated channels / 2), "
                                      f"got {value!r}")
            for v in value:
                _number(where, key, v, minimum=0, strict=True)
        if params.get("factor") is None:  # transformers: derive it from the two lengths
            params["factor"] = (max_pos or params["original_max_position_embeddings"]) / params[
                "original_max_position_embeddings"]
    return RopeSpec(rope_type, theta, int(head_dim), float(prf), dim, params, max_pos, where,
                    angle_precision(hf_config, top))


def angle_precision(cfg: dict, top: str = "config") -> str:
    """The angle precision an HF config dict declares (`rope_angle_precision`; absent or null: float64).
    RopeConfigError naming `<top>.rope_angle_precision` for any other value."""
    value = cfg.get(ANGLE_PRECISION_KEY) or "float64"
    if value not in ANGLE_PRECISIONS:
        raise RopeConfigError(f"{top}.{ANGLE_PRECISION_KEY} = {value!r}: must be one of {list(ANGLE_PRECISIONS)} "
                              "(float32: the angles transformers and serving engines form; float64: exact)")
    return value
