"""What a recipe inherits from its model's source (`model.preset` or `model.hf_config`): the architecture
fields it leaves unset and the rope, with the rules for `rope.preset` and for rope blocks that leave out the
model's own fields. Works on the raw dict, before the schema builds the frozen recipe.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from megatron_ext.presets import HF_LLAMA_RMS_NORM_EPS, PRESETS, ROPE_PRESETS
from megatron_ext.recipe import ModelConfig, RopeConfig
from megatron_ext.recipe_schema import RecipeError, bad_value
from megatron_ext.rope_spec import ANGLE_PRECISION_KEY


def _hf_config_file(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise RecipeError(f"model.hf_config = {path!r}: no config.json there; give an HF model folder or config.json")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"model.hf_config = {path!r}: {p} is not valid JSON ({e}); give an HF model folder or "
                          "its config.json") from None
    if not isinstance(cfg, dict):
        raise RecipeError(f"model.hf_config = {path!r}: {p} holds a {type(cfg).__name__}, not an HF config mapping")
    return cfg


def _architecture_source(model: dict) -> dict | None:
    preset, hf = model.get("preset"), model.get("hf_config")
    if preset is not None and hf is not None:
        raise RecipeError("model.preset and model.hf_config are both set; keep one")
    if preset is not None:
        if preset not in PRESETS:
            raise bad_value("model.preset", preset, f"one of {sorted(PRESETS)}")
        return PRESETS[preset]
    if hf is not None:
        if not isinstance(hf, str):
            raise bad_value("model.hf_config", hf, "a path")
        return {"rms_norm_eps": HF_LLAMA_RMS_NORM_EPS, **_hf_config_file(hf)}
    return None


def rope_from_hf_config(cfg: dict) -> dict:
    """RoPE section from an HF config in either transformers-4 or -5 form."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        if "rope_theta" in cfg:
            params["rope_theta"] = cfg["rope_theta"]
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if cfg.get(ANGLE_PRECISION_KEY) is not None:
        params["angle_precision"] = cfg[ANGLE_PRECISION_KEY]
    valid = {f.name for f in fields(RopeConfig)}
    return {k: v for k, v in params.items() if k in valid}


def _model_rope(raw: dict) -> dict | None:
    """The rope of the recipe's model preset / HF config, or None for a model given by its sizes alone."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return None
    source = _architecture_source(model)
    return rope_from_hf_config(source) if source is not None else None


def fill_rope(raw: dict) -> dict:
    """Without a `rope` section, or with an empty one (`rope: null`, `rope={}`), the model's own rope applies
    (and overrides edit it). Returns the filled-in fields, so that a later `rope.preset` can replace them.
    """
    if raw.get("rope") not in (None, {}):
        return {}
    own = _model_rope(raw)
    if own is None:
        return {}
    raw["rope"] = own
    return dict(own)


# Properties of the model rather than of the scaling: in an HF config they sit beside `rope_scaling`.
_MODEL_ROPE_FIELDS = ("rope_theta", "partial_rotary_factor", "angle_precision")


def fill_model_rope_fields(raw: dict) -> None:
    """A rope block that leaves out theta, the rotary fraction or the angle precision keeps the model's, not the
    schema default: a YaRN block written without `rope_theta` on Llama-3.1 means theta 500000, never 10000."""
    rope, own = raw.get("rope"), _model_rope(raw)
    if not isinstance(rope, dict) or own is None:
        return
    for key in _MODEL_ROPE_FIELDS:
        if key not in rope and key in own:
            rope[key] = own[key]


def fill_rope_preset(raw: dict, inherited: dict) -> None:
    """`rope.preset` replaces the rope inherited from the model; fields set explicitly beside it win."""
    rope = raw.get("rope")
    if not isinstance(rope, dict) or rope.get("preset") is None:
        return
    name = rope["preset"]
    if name not in ROPE_PRESETS:
        raise bad_value("rope.preset", name, f"one of {sorted(ROPE_PRESETS)}")
    explicit = {k: v for k, v in rope.items() if k != "preset" and (k not in inherited or inherited[k] != v)}
    raw["rope"] = {**ROPE_PRESETS[name], **explicit, "preset": name}


def fill_model(raw: dict) -> None:
    model = raw.get("model") or {}
    if not isinstance(model, dict):
        raise bad_value("model", model, "a mapping (e.g. {preset: llama3.1-8b})")
    model = dict(model)
    source = _architecture_source(model)
    if source is not None:
        for f in fields(ModelConfig):
            if f.name in source and model.get(f.name) is None and f.name not in ("preset", "hf_config"):
                model[f.name] = source[f.name]
    raw["model"] = model
