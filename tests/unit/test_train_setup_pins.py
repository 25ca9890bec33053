"""Pins of `megatron_ext.train_setup` (mutation audit round 4): the boundaries of the tokenizer and positions
checks, a hub tokenizer name, and which runs get which warning or advice, against hand numbers and the
`tokenizers` library's own count of a tokenizer's ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.recipe import RecipeError, load_recipe
from megatron_ext.train_setup import (_largest_token_id, check_setup, out_of_memory_advice, positions_warning,
                                      selective_recompute_warning)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/tiny/cpt.yaml"
TINY = ["parallel.context=1", "train.seq_length=256", "train.global_batch_size=2", "train.steps=2"]


def _recipe(*overrides: str):
    return load_recipe(RECIPE, [*TINY, *overrides], world_size=1)


def test_largest_token_id_counts_the_vocabulary_and_the_added_tokens():
    """Hand numbers: a dict vocabulary's largest id, a list vocabulary (Unigram) of 5 pieces ids 0..4, added tokens."""
    assert _largest_token_id({"model": {"vocab": {"a": 0, "b": 7, "c": 3}}}) == 7
    assert _largest_token_id({"model": {"vocab": {"a": 0, "b": 7}}, "added_tokens": [{"id": 9}, {"id": 8}]}) == 9
    assert _largest_token_id({"model": {"vocab": [["a", 0.0]] * 5}}) == 4
    assert _largest_token_id({"model": {}}) is None


def test_tokenizer_check_boundary_and_hub_name(tmp_path, token_data, toy_tokenizer):
    """model.vocab_size must exceed the tokenizer's largest id (ids 0..V-1), counted by the `tokenizers` library;
    a hub name (`org/name`, one slash) is not a local path and is not looked for on disk."""
    from tokenizers import Tokenizer

    largest = Tokenizer.from_file(str(Path(toy_tokenizer) / "tokenizer.json")).get_vocab_size(True) - 1
    base = [f"data.prefix={token_data}", f"model.tokenizer={toy_tokenizer}"]
    with pytest.raises(RecipeError, match=rf"makes token ids up to {largest}, but model\.vocab_size = {largest} "):
        check_setup(_recipe(f"checkpoint.dir={tmp_path / 'a'}", *base, f"model.vocab_size={largest}"))
    check_setup(_recipe(f"checkpoint.dir={tmp_path / 'b'}", *base, f"model.vocab_size={largest + 1}"))
    check_setup(_recipe(f"checkpoint.dir={tmp_path / 'c'}", f"data.prefix={token_data}",
                        "model.tokenizer=meta-llama/Llama-3.1-8B"))


def test_positions_warning_only_beyond_the_models_positions():
    assert positions_warning(_recipe("model.max_position_embeddings=256")) is None  # seq 256 == positions
    assert "train.seq_length = 256 is beyond model.max_position_embeddings = 255" in positions_warning(
        _recipe("model.max_position_embeddings=255", "rope.original_max_position_embeddings=128"))


def test_selective_recompute_warned_only_under_transformer_engine_on_gpus():
    cuda = ["runtime.device=cuda", "train.recompute=selective"]
    assert selective_recompute_warning(_recipe(*cuda, "runtime.attention=te")) is not None
    assert selective_recompute_warning(_recipe(*cuda, "runtime.attention=sdpa")) is None  # torch keeps the scores
    assert selective_recompute_warning(_recipe("runtime.device=cpu", "train.recompute=selective")) is None


def test_out_of_memory_advice_names_the_planner_on_gpus_only():
    assert "tools/plan.py" in out_of_memory_advice(_recipe("runtime.device=cuda"), "r.yaml", [], 2)
    assert "tools/plan.py" not in out_of_memory_advice(_recipe("runtime.device=cpu"), "r.yaml", [], 2)


def test_a_manifest_from_before_vocabulary_hashes_is_not_refused(tmp_path, token_data, toy_tokenizer):
    """Manifests written before 2026-12 record no vocabulary_hash: nothing to compare with model.tokenizer, so the
    data is taken (mutation audit round 4: a missing hash compared unequal and refused every older dataset)."""
    import json
    import shutil

    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(token_data + suffix, tmp_path / ("old" + suffix))
    manifest = json.loads((tmp_path / "old.json").read_text())
    assert manifest.pop("vocabulary_hash")
    (tmp_path / "old.json").write_text(json.dumps(manifest))
    check_setup(_recipe(f"checkpoint.dir={tmp_path / 'run'}", f"data.prefix={tmp_path / 'old'}",
                        f"model.tokenizer={toy_tokenizer}"))


def test_a_truncated_sft_loss_mask_is_refused_before_the_run(tmp_path, sft_data):
    """SFT data is its tokens and PREFIX_lossmask.bin/.idx: a loss mask cut short must fail the setup check, not the
    run (mutation audit round 4: checking the tokens alone for SFT went unnoticed)."""
    import shutil

    for name in ("", "_lossmask"):
        for suffix in (".bin", ".idx", ".json"):
            if Path(sft_data + name + suffix).exists():
                shutil.copy(sft_data + name + suffix, tmp_path / ("sft" + name + suffix))
    prefix = str(tmp_path / "sft")
    mask = Path(prefix + "_lossmask.bin")
    mask.write_bytes(mask.read_bytes()[:-8])

    def check():
        check_setup(load_recipe(ROOT / "recipes/tiny/sft.yaml", [f"checkpoint.dir={tmp_path / 'run'}",
                                f"data.prefix={prefix}", "checkpoint.init_from=null"], world_size=1))

    with pytest.raises(RecipeError, match=r"_lossmask"):
        check()
