"""Pins of where a recipe's model and rope come from (megatron_ext.recipe_sources) from the mutation audit (round 9):
a preset or HF config that is not there, not JSON, not a mapping or not a path is one RecipeError naming it; extra keys
of an HF rope block are left out as transformers leaves them; a value set beside `rope.preset` wins also when it
replaces the inherited one."""

import json

import pytest

from megatron_ext.presets import PRESETS, ROPE_PRESETS, TINY
from megatron_ext.recipe import RecipeError, load_recipe
from tests.unit.test_recipe import BASE


def error(raw=BASE, overrides=()):
    with pytest.raises(RecipeError) as e:
        load_recipe(raw=raw, overrides=list(overrides))
    return str(e.value)


def hf(path):
    return {**BASE, "model": {"hf_config": str(path)}}


def test_model_sources_that_are_no_config(tmp_path):
    """A config.json that is a folder (RSO2: IsADirectoryError), not UTF-8 (RSO3: UnicodeDecodeError) or a JSON list
    (RSO4: TypeError; RSO34: the file unnamed); an hf_config that is no path (RSO7: TypeError)."""
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    assert error(hf(tmp_path / "dir")) == (f"model.hf_config = {str(tmp_path / 'dir')!r}: no config.json there; give "
                                           "an HF model folder or config.json")
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"a": "\xff"}')
    assert error(hf(tmp_path)).startswith(f"model.hf_config = {str(tmp_path)!r}: {cfg} is not valid JSON (")
    cfg.write_text("[1, 2]")
    assert error(hf(tmp_path)) == f"model.hf_config = {str(tmp_path)!r}: {cfg} holds a list, not an HF config mapping"
    assert error({**BASE, "model": {"hf_config": 5}}) == "model.hf_config = 5: expected a path"


def test_unknown_presets_list_the_known(tmp_path):
    """An unknown model or rope preset names the valid ones (RSO6: KeyError; RSO31/32: the list left out); an empty
    rope preset name is one too (RSO29: taken as no preset)."""
    assert error(overrides=["model.preset=llama9"]) == f"model.preset = 'llama9': expected one of {sorted(PRESETS)}"
    for name in ("ultralong-8m", ""):
        assert error({**BASE, "rope": {"preset": name}}) == \
            f"rope.preset = {name!r}: expected one of {sorted(ROPE_PRESETS)}"


def test_a_model_given_by_its_name_alone():
    """`model: llama3.1-8b` (for `model: {preset: llama3.1-8b}`) is one line with the fix (RSO26: ValueError from
    dict('llama3.1-8b'); RSO27: AttributeError)."""
    assert error({**BASE, "model": "llama3.1-8b"}) == "model = 'llama3.1-8b': expected a mapping (e.g. {preset: " \
                                                      "llama3.1-8b})"


def test_extra_keys_of_an_hf_rope_block_are_left_out(tmp_path):
    """A YaRN config as NousResearch/Yarn-Llama-2 ships it (`type` and `finetuned` in rope_scaling) loads with the
    rope transformers reads from it (RSO14: 'rope.finetuned: unknown key')."""
    from transformers import LlamaConfig

    cfg = {**TINY, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "finetuned": True}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rope = load_recipe(raw=hf(tmp_path)).rope
    theirs = LlamaConfig(**cfg).rope_parameters
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings, rope.rope_theta) == \
        (theirs["rope_type"], theirs["factor"], theirs["original_max_position_embeddings"], theirs["rope_theta"]) == \
        ("yarn", 4.0, 64, TINY["rope_theta"])


def test_a_value_beside_the_preset_wins_also_over_the_inherited_one():
    """`rope.preset=ultralong-1m rope.rope_theta=1e6` on Llama-3.1 (theta 500000 inherited) trains with theta 1e6,
    not the preset's 500000 (RSO21: a value equal in key to an inherited one was dropped)."""
    raw = {**BASE, "model": {"preset": "llama3.1-8b"}, "train": {**BASE["train"], "seq_length": 8192}}
    assert PRESETS["llama3.1-8b"]["rope_theta"] == ROPE_PRESETS["ultralong-1m"]["rope_theta"] == 500000
    rope = load_recipe(raw=raw, overrides=["rope.preset=ultralong-1m", "rope.rope_theta=1000000"],
                       world_size=2).rope
    assert (rope.rope_type, rope.factor, rope.rope_theta) == ("yarn", 128.0, 1e6)
