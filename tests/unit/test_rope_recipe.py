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


def test_angle_precision_travels_in_the_hf_config_and_back(tmp_path):
    """`rope.angle_precision: float32` writes `rope_angle_precision` into the HF config (absent for the default,
    so plain runs export plain Llama configs); a recipe built on such a config.json keeps it, also under a preset."""
    import json

    assert "rope_angle_precision" not in hf_config_from_recipe(load({"preset": "ultralong-1m"}))
    cfg = hf_config_from_recipe(load({"preset": "ultralong-1m", "angle_precision": "float32"}))
    assert cfg["rope_angle_precision"] == "float32"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for rope in (None, {"preset": "ultralong-2m"}):
        raw = {**BASE, "model": {"hf_config": str(tmp_path)}, **({"rope": rope} if rope else {})}
        assert load_recipe(raw=raw).rope.angle_precision == "float32"
    raw = {**BASE, "model": {"hf_config": str(tmp_path)}, "rope": {"preset": "ultralong-2m",
                                                                      "angle_precision": "float64"}}
    assert load_recipe(raw=raw).rope.angle_precision == "float64"  # set beside the preset: it wins


def test_a_changed_angle_precision_is_a_rope_change():
    """Resuming or starting an SFT from a checkpoint trained with other angles is reported like another theta."""
    from megatron_ext.resume import rope_changes

    recipe = load({"preset": "ultralong-1m"})
    saved = hf_config_from_recipe(recipe)
    assert rope_changes(saved, recipe) == []
    assert rope_changes({**saved, "rope_angle_precision": "float64"}, recipe) == []  # absent means float64
    assert rope_changes({**saved, "rope_angle_precision": None}, recipe) == []  # null too, as rope_spec reads it
    assert rope_changes({**saved, "rope_angle_precision": "float32"}, recipe) == \
        ["rope_angle_precision: float32 -> float64"]


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
