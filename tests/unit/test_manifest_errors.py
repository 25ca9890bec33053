"""A damaged dataset manifest (PREFIX.json beside PREFIX.bin/.idx) is one `error:` line naming the file, what is
wrong and the fix (prepare the data again), in the trainer's setup check and the launcher's --check. It was a
traceback: KeyError 'vocab_size' (fields missing), UnicodeDecodeError (not UTF-8), AttributeError (a JSON list)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_ext.data import DataError
from megatron_ext.data.dataset_files import read_manifest

ROOT = Path(__file__).resolve().parents[2]


def _copy(prefix: str, folder: Path) -> str:
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(prefix + suffix, folder / ("cpt" + suffix))
    return str(folder / "cpt")


def _without(*keys: str):
    return lambda m: {k: v for k, v in m.items() if k not in keys}


# (what is done to the manifest: a function of the parsed one, or the bytes written; what the message says)
DAMAGE = {
    "no vocab_size or max_token_id": (_without("vocab_size", "max_token_id"), r"no vocab_size"),
    "no vocab_size": (_without("vocab_size"), r"no vocab_size"),
    "no tokens": (_without("tokens"), r"no tokens"),
    "no tokenizer_hash": (_without("tokenizer_hash"), r"no tokenizer_hash"),
    "no kind": (_without("kind"), r"no kind"),
    "another kind": (lambda m: {**m, "kind": "rlhf"}, r"kind 'rlhf', not 'cpt' or 'sft'"),
    "vocab_size a string": (lambda m: {**m, "vocab_size": "512"}, r"vocab_size = '512', not a whole number"),
    "max_token_id null": (lambda m: {**m, "max_token_id": None}, r"max_token_id = None, not a whole number"),
    "a JSON list": (lambda m: [m], r"a JSON list, not an object"),
    "a JSON string": (lambda m: "cpt", r"a JSON str, not an object"),
    "not UTF-8": (b'{"kind": "cpt", "tokenizer": "\xff\xfe"}', r"truncated or corrupt \('utf-8' codec can't decode"),
}


def _damage(prefix: str, how) -> None:
    path = Path(prefix + ".json")
    if isinstance(how, bytes):
        path.write_bytes(how)
    else:
        path.write_text(json.dumps(how(json.loads(path.read_text()))))


@pytest.mark.parametrize("case", list(DAMAGE))
def test_read_manifest_names_the_damage(case, tmp_path, token_data):
    prefix = _copy(token_data, tmp_path)
    assert read_manifest(prefix, "cpt")["kind"] == "cpt"  # the copy is fine before the damage
    how, what = DAMAGE[case]
    _damage(prefix, how)
    with pytest.raises(DataError, match=rf"^data prefix {prefix}: {prefix}\.json is .*{what}.*; prepare the data "
                                        r"again \(tools/prepare_data\.py\)$"):
        read_manifest(prefix, "cpt")


def test_an_older_manifest_without_max_token_id_still_reads(tmp_path, token_data):
    prefix = _copy(token_data, tmp_path)
    _damage(prefix, _without("max_token_id"))
    assert "max_token_id" not in read_manifest(prefix, "cpt")


@pytest.mark.parametrize("case", ["no vocab_size or max_token_id", "not UTF-8", "a JSON list"])
def test_trainer_setup_check_is_one_error(case, tmp_path, token_data):
    from megatron_ext.recipe import RecipeError, load_recipe
    from megatron_ext.train_setup import check_setup

    prefix = _copy(token_data, tmp_path)
    _damage(prefix, DAMAGE[case][0])
    recipe = load_recipe(ROOT / "recipes/tiny/cpt.yaml", ["parallel.context=1", "train.seq_length=256",
                                                           "train.global_batch_size=2", "train.steps=2",
                                                           f"checkpoint.dir={tmp_path / 'run'}",
                                                           f"data.prefix={prefix}"], world_size=1)
    with pytest.raises(RecipeError, match=rf"{prefix}\.json .*{DAMAGE[case][1]}.*prepare the data again"):
        check_setup(recipe)


@pytest.mark.parametrize("case", ["no vocab_size or max_token_id", "not UTF-8", "a JSON list"])
def test_launcher_check_data_is_one_error_line(case, tmp_path, token_data, monkeypatch, capsys):
    from megatron_ext import launch

    prefix = _copy(token_data, tmp_path)
    _damage(prefix, DAMAGE[case][0])
    monkeypatch.chdir(ROOT)
    code = launch.main(["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", f"data.prefix={prefix}",
                        "--check-data"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith(f"error: data prefix {prefix}: {prefix}.json is ") and err.count("\n") == 1, err
    assert "prepare the data again (tools/prepare_data.py)" in err


def test_the_loss_mask_of_an_sft_dataset_given_as_the_dataset(tmp_path, sft_data, capsys):
    """data.prefix naming PREFIX_lossmask (its .bin/.idx are there): the line names the dataset it belongs to, for
    both stages' recipes; it said 'PREFIX_lossmask.json not found; run tools/prepare_data.py first'. A _lossmask prefix
    of no SFT dataset keeps that line. Control: without the check, the old line."""
    from megatron_ext import launch

    mask = sft_data + "_lossmask"
    said = f"data.prefix = '{mask}' is the loss mask of the SFT dataset {sft_data}; give data.prefix={sft_data}"
    with pytest.raises(DataError) as e:
        read_manifest(mask, "sft")
    assert str(e.value) == said
    for stage in ("sft", "cpt"):
        code = launch.main(["--check", "--recipe", str(ROOT / f"recipes/tiny/{stage}.yaml"), "--world-size", "2",
                            f"data.prefix={mask}", f"checkpoint.dir={tmp_path / 'run'}", "checkpoint.init_from=null"])
        assert code == 1 and capsys.readouterr().err == f"error: {said}\n"
    alone = tmp_path / "other_lossmask"
    for suffix in (".bin", ".idx"):
        shutil.copy(mask + suffix, str(alone) + suffix)
    with pytest.raises(DataError, match=r"other_lossmask\.json not found; run tools/prepare_data\.py first"):
        read_manifest(str(alone), "sft")
