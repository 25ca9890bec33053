"""`tools/checkpoint.py info` and `reshard` on damaged run metadata (ITER/megatron_ext.json): one `error:` line
naming the file and exit 1. A JSON list was an AttributeError traceback; `{}` was described as `? layers, hidden ?`
with exit 0, where the converter says "metadata has no hf_config"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.checkpoint_cli import main

HF = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
      "vocab_size": 512}


def _checkpoint(tmp_path: Path, meta: object) -> tuple[Path, Path]:
    """A checkpoint root whose latest iteration has `meta` as its metadata (no shards: the metadata is read first)."""
    root = tmp_path / "run"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    file = root / "iter_0000002" / "megatron_ext.json"
    file.write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    return root, file


CASES = {
    "a list": ([], "{file} holds a JSON list, not an object; the checkpoint metadata is corrupt"),
    "a number": (3, "{file} holds a JSON int, not an object; the checkpoint metadata is corrupt"),
    "empty": ({}, "{iter}: metadata has no hf_config; cannot tell the architecture ({file} was not written by "
                  "megatron_ext.checkpoint, or is damaged)"),
    "hf_config a string": ({"hf_config": "llama"}, "{iter}: metadata has no hf_config"),
    "recipe a list": ({"hf_config": HF, "recipe": []}, "{file}: recipe is a JSON list, not an object"),
    "train a string": ({"hf_config": HF, "recipe": {"train": "cpt"}}, "{file}: recipe.train is a JSON str, not an "
                                                                      "object"),
    "versions a list": ({"hf_config": HF, "versions": ["2.13"]}, "{file}: versions is a JSON list, not an object"),
    "not UTF-8": (b'{"hf_config": "\xff"}', "{file} is not UTF-8 text ("),
}


@pytest.mark.parametrize("case", list(CASES))
def test_info_on_damaged_metadata_is_one_error(case, tmp_path, capsys):
    meta, message = CASES[case]
    root, file = _checkpoint(tmp_path, meta)
    code = main(["info", str(root)])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    expected = message.format(file=file, iter=file.parent)
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err


def test_info_on_sound_metadata_describes_it(tmp_path, capsys):
    """The control: the smallest metadata with the model's config reads (the files' completeness aside)."""
    root, _ = _checkpoint(tmp_path, {"hf_config": HF})
    code = main(["info", str(root)])
    out, _ = capsys.readouterr()
    assert code == 1 and "model: 2 layers, hidden 64, heads 4/2, vocab 512" in out  # 1: no shards, incomplete


@pytest.mark.parametrize("case", ["a list", "empty"])
def test_reshard_on_damaged_metadata_is_one_error(case, tmp_path, capsys):
    meta, message = CASES[case]
    root, file = _checkpoint(tmp_path, meta)
    code = main(["reshard", str(root), "--out", str(tmp_path / "new")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"error: {message.format(file=file, iter=file.parent)}"), err
    assert not (tmp_path / "new").exists()  # refused before anything is written
