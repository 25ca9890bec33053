"""The HF Llama `config.json` dict (transformers-4 form: `rope_theta` + `rope_scaling`), the one architecture
description every part shares: the recipe is turned into it, the converter writes it into checkpoint metadata,
and the model is built from it (`megatron_ext.model`). Plain dicts, no torch: the preflight's resume report
compares a checkpoint's with the recipe's on a login node.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from megatron_ext.presets import HF_LLAMA_RMS_NORM_EPS
from megatron_ext.recipe import Recipe, RopeConfig
from megatron_ext.rope_spec import ANGLE_PRECISION_KEY, ROPE_FIELDS

_ROPE_SCALING_KEYS = [f for f in RopeConfig.__dataclass_fields__ if f not in ("rope_theta", "rope_type",
                                                                                 "partial_rotary_factor",
                                                                                 "angle_precision")]


def normalize_hf_config(cfg: dict) -> dict:
    """Copy of an HF Llama config in transformers-4 form, with head_dim and KV heads filled in.

    Accepts the transformers-5 form (`rope_parameters`) and the old `rope_scaling.type` key.
    """
    out = copy.deepcopy(cfg)
    params = out.pop("rope_parameters", None)
    if params:
        params = dict(params)
        if "rope_theta" in params:
            out["rope_theta"] = params.pop("rope_theta")
        if "partial_rotary_factor" in params:
            out["partial_rotary_factor"] = params.pop("partial_rotary_factor")
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        out["rope_scaling"] = None if rope_type == "default" and not params else {"rope_type": rope_type, **params}
    scaling = out.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
            scaling.pop("type", None)
        out["rope_scaling"] = None if scaling.get("rope_type") == "default" and len(scaling) == 1 else scaling
    out.setdefault("rope_theta", 10000.0)
    out.setdefault("rope_scaling", None)
    if out.get("num_key_value_heads") is None:  # absent or null: transformers takes one KV head per head (MHA)
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out.get("head_dim") is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    out.setdefault("rms_norm_eps", HF_LLAMA_RMS_NORM_EPS)
    out.setdefault("tie_word_embeddings", False)
    return out


def hf_config_from_recipe(recipe: Recipe) -> dict:
    """The HF Llama `config.json` dict (transformers-4 form) that the recipe's model and rope describe."""
    m, r = recipe.model, recipe.rope
    scaling = None
    if r.rope_type != "default":
        scaling = {"rope_type": r.rope_type}
        for key in _ROPE_SCALING_KEYS:
            value = getattr(r, key)
            if value is not None and key in ROPE_FIELDS[r.rope_type]:  # fields of this rope type only
                scaling[key] = list(value) if isinstance(value, tuple) else value
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads or m.num_attention_heads,
        "head_dim": m.head_dim or m.hidden_size // m.num_attention_heads,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.rms_norm_eps,
        "tie_word_embeddings": m.tie_word_embeddings,
        "max_position_embeddings": recipe.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": m.initializer_range,
        "rope_theta": r.rope_theta,
        "rope_scaling": scaling,
    }
    if r.partial_rotary_factor != 1.0:
        cfg["partial_rotary_factor"] = r.partial_rotary_factor
    if r.angle_precision != "float64":  # our own key: configs of default runs stay plain HF Llama ones
        cfg[ANGLE_PRECISION_KEY] = r.angle_precision
    return cfg


def read_config_json(path: str | Path) -> dict:
    """An HF `config.json` as a dict; ValueError saying what is wrong with the file (not UTF-8, not JSON, not an
    object of fields) for the caller to name it in its own error."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not an object of config fields")
    return raw


def pruned_link_problem(hf_dir: Path, name: str) -> str | None:
    """The one-line error for file `name` of model folder `hf_dir` when it is a symlink to nothing usable (a hub
    cache whose blobs were pruned: the link stays, the file is gone), else None. Any other missing file is the
    caller's to name."""
    path = hf_dir / name
    if not path.is_symlink() or path.is_file():
        return None
    state = "is not a file" if path.exists() else "does not exist"
    return f"--hf {hf_dir}: {name} is a symlink to {os.readlink(path)}, which {state}; download the model again"
