"""What `tools/niah.py` reads before the model loads (megatron_ext.evaluate.cli_model): the tokenizer of --model
with --tokenizer, of a --megatron checkpoint (its run metadata, or --tokenizer), the name ppl --indexed's refusal
tells the user to prepare the data with, and the vocabulary size; and the checkpoint metadata it cannot read
(not UTF-8, not an object, a folder of no model), which the converter reports instead of a traceback here. The CLI
tests run these through whole commands, where another check says the same thing first (mutation audit round 9).

The checkpoints here are folders holding only the run metadata (megatron_ext.json), all these functions read."""

import json
from argparse import Namespace

import pytest

from megatron_ext.checkpoint_index import METADATA_FILE
from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate.cli_model import data_tokenizer, early_tokenizer, model_vocab_size
from tests.unit.test_evaluate import tiny_dir  # noqa: F401 (fixture)


def _args(model=None, megatron=None, tokenizer=None, engine="hf"):
    return Namespace(model=model, megatron=megatron, tokenizer=tokenizer, engine=engine)


def _checkpoint(folder, meta):
    folder.mkdir()
    (folder / METADATA_FILE).write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    return folder


@pytest.fixture
def hf_folder(tmp_path, toy_tokenizer):
    """An HF model folder: config.json (vocab_size 512) and the toy tokenizer's files."""
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(toy_tokenizer, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 512}))
    return folder


def test_the_tokenizer_given_beats_the_models_own(hf_folder, toy_tokenizer, tmp_path):
    """--model with --tokenizer: the given one is loaded (ruler's prompts and ppl's data check use it); without,
    the model folder's; a --model that is not there: None (the loader then says so, not a tokenizer error)."""
    assert early_tokenizer(_args(model=hf_folder, tokenizer=toy_tokenizer)).name_or_path == toy_tokenizer
    assert early_tokenizer(_args(model=hf_folder)).name_or_path == str(hf_folder)
    assert early_tokenizer(_args(model=tmp_path / "nope")) is None
    tok, name = data_tokenizer(_args(model=hf_folder, tokenizer=toy_tokenizer))
    assert (tok.name_or_path, name) == (toy_tokenizer, toy_tokenizer)  # "prepare it again with --tokenizer NAME"
    assert data_tokenizer(_args(model=hf_folder))[1] == str(hf_folder)


def test_a_megatron_checkpoint_s_recorded_tokenizer(tmp_path, toy_tokenizer):
    """--megatron: the tokenizer its metadata records (or --tokenizer's), named as the user passed it."""
    ck = _checkpoint(tmp_path / "ck", {"tokenizer": toy_tokenizer, "hf_config": {"vocab_size": 512}})
    assert early_tokenizer(_args(megatron=ck)).name_or_path == toy_tokenizer
    tok, name = data_tokenizer(_args(megatron=ck))
    assert (tok.name_or_path, name) == (toy_tokenizer, toy_tokenizer)
    bare = _checkpoint(tmp_path / "bare", {"tokenizer": None, "hf_config": {"vocab_size": 512}})
    tok, name = data_tokenizer(_args(megatron=bare, tokenizer=toy_tokenizer))
    assert (tok.name_or_path, name) == (toy_tokenizer, toy_tokenizer)
    assert model_vocab_size(_args(megatron=ck)) == 512


def test_a_recorded_tokenizer_that_does_not_load(tmp_path):
    """The transformers engine needs the tokenizer: its EvalError, one line naming the checkpoint; the Megatron
    engine reads token ids alone: nothing to compare, no error."""
    ck = _checkpoint(tmp_path / "ck", {"tokenizer": str(tmp_path / "gone"), "hf_config": {"vocab_size": 512}})
    with pytest.raises(EvalError, match=f"^--megatron {ck}: cannot load its tokenizer"):
        data_tokenizer(_args(megatron=ck))
    assert data_tokenizer(_args(megatron=ck, engine="megatron")) == (None, None)


@pytest.mark.parametrize("meta", [b"\xff\xfe not UTF-8", ["a", "list"], "text"])
def test_metadata_that_cannot_be_read_is_left_to_the_converter(tmp_path, meta):
    """No traceback (UnicodeDecodeError, AttributeError of a list) before the converter's own message."""
    ck = _checkpoint(tmp_path / "ck", meta)
    assert early_tokenizer(_args(megatron=ck)) is None
    assert data_tokenizer(_args(megatron=ck)) == (None, None)


@pytest.mark.parametrize("config, vocab", [('{"vocab_size": 512}', 512), ("{", None), ('{"vocab_size": "many"}', None),
                                           ("[1]", None)])
def test_vocab_size_read_before_the_model(tmp_path, config, vocab):
    """The int config.json gives, or None where it is broken: loading the model then says what is wrong, not a
    ValueError or TypeError here."""
    (tmp_path / "config.json").write_text(config)
    assert model_vocab_size(_args(model=tmp_path)) == vocab


def test_a_tokenizer_with_more_ids_than_the_model_is_named_by_its_flag(tiny_dir, tmp_path):
    """--model with a --tokenizer of more ids than the model's embeddings: the one line names --tokenizer (the
    model folder's own tokenizer is not the culprit)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.evaluate.cli import main
    from megatron_ext.presets import TINY

    words = {f"w{i}": i for i in range(TINY["vocab_size"] + 10)}
    big = tmp_path / "big"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")),
                            unk_token="w0").save_pretrained(big)
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_dir), "--tokenizer", str(big), "--out", str(tmp_path / "o"), "--lengths", "64",
              "--depths", "50", "--device", "cpu", "--no-progress"])
    assert f"--tokenizer {big} has {TINY['vocab_size'] + 10} tokens but the model's vocab_size is " \
           f"{TINY['vocab_size']}" in e.value.code, e.value.code
