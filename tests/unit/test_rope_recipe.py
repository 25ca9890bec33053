"""RoPE from recipes: UltraLong presets (`rope: {preset: ultralong-1m}`), rope checks at load time,
and the HF config a recipe turns into."""

import pytest

from megatron_ext.hf_config import hf_config_from_recipe
from megatron_ext.presets import ROPE_PRESETS
from megatron_ext.recipe import RecipeError, load_recipe
from megatron_ext.rope import rope_frequencies

BASE = {"model": {"preset": "llama3.1-8b"}, "train": {"seq_length": 8192, "steps": 1, "lr": 1e-5},
        "cluster": {"gpus_per_node": 1}}


def load(rope=None, overrides=()):
    raw = dict(BASE, **({"rope": rope} if rope is not None else {}))
    return load_recipe(raw=raw, overrides=list(overrides))


@pytest.mark.parametrize("name, factor", [("ultralong-1m", 128), ("ultralong-2m", 256), ("ultralong-4m", 512)])
def test_preset_gives_the_paper_settings(name, factor):
    r = load({"preset": name}).rope
    assert (r.rope_type, r.rope_theta, r.factor, r.original_max_position_embeddings, r.beta_fast, r.beta_slow) == \
        ("yarn", 500000.0, factor, 8192, 4.0, 1.0)
    assert r.low_freq_factor is None and r.preset == name


def test_preset_spelled_out_is_the_same_model():
    spelled = load({k: v for k, v in ROPE_PRESETS["ultralong-1m"].items()})
    preset = load({"preset": "ultralong-1m"})
    assert hf_config_from_recipe(spelled) == hf_config_from_recipe(preset)
    cfg = hf_config_from_recipe(preset)
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 128.0, "original_max_position_embeddings": 8192,
                                   "beta_fast": 4.0, "beta_slow": 1.0}
    assert round(rope_frequencies(cfg)[1], 3) == 1.485


def test_preset_as_override_replaces_the_inherited_llama3_rope():
    r = load(overrides=["rope.preset=ultralong-4m"]).rope
    assert r.rope_type == "yarn" and r.factor == 512 and r.low_freq_factor is None


def test_fields_beside_the_preset_win():
    r = load({"preset": "ultralong-1m", "beta_fast": 8.0}).rope
    assert r.beta_fast == 8.0 and r.factor == 128
    r = load({"preset": "ultralong-1m"}, overrides=["rope.factor=64"]).rope
    assert r.factor == 64


def test_type_override_writes_only_that_types_fields():
    cfg = hf_config_from_recipe(load(overrides=["rope.rope_type=yarn"]))  # llama3 fields inherited, unused
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    rope_frequencies(cfg)  # the builder accepts it


@pytest.mark.parametrize("rope, message", [
    ({"preset": "ultralong-8m"}, "rope.preset = 'ultralong-8m'"),
    ({"preset": "ultralong-1m", "beta_fast": 1.0, "beta_slow": 4.0}, "rope.beta_fast = 1.0: must be above beta_slow"),
    ({"preset": "ultralong-1m", "factor": 0.5}, "rope.factor = 0.5: must be >= 1"),
    ({"preset": "ultralong-1m", "original_max_position_embeddings": 262144},
     "rope.original_max_position_embeddings = 262144: above max_position_embeddings = 131072"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "rope.short_factor: must be a list of 64"),
])
def test_bad_rope_is_caught_at_load(rope, message):
    with pytest.raises(RecipeError) as e:
        load(rope)
    assert message in str(e.value), str(e.value)
