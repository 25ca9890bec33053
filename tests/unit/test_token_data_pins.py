"""`token_data_problem` (megatron_ext.evaluate.token_data) on what it must let through: the CLI tests cover the
refusals (another tokenizer, an SFT dataset, its loss mask), not a manifest of an older version without a
vocabulary hash, a tokenizer without a fast backend, or data with no manifest at all (another pipeline's), all of
which `niah.py ppl --indexed` and `quantize.py --calib` read as they are (mutation audit round 7)."""

import json
import shutil

from transformers import AutoTokenizer

from megatron_ext.evaluate.token_data import model_vocabulary_hash, token_data_problem


def _copy(token_data, folder, with_manifest=True):
    for suffix in (".bin", ".idx") + ((".json",) if with_manifest else ()):
        shutil.copy(token_data + suffix, folder / ("d" + suffix))
    return str(folder / "d")


class _SlowTokenizer:
    """A tokenizer without a fast (Rust) backend: no `backend_tokenizer`, as transformers' Python tokenizers."""

    name_or_path = "slow"


def test_the_vocabulary_hash_is_the_one_prepare_data_records(token_data, toy_tokenizer):
    """The oracle: the manifest prepare_data.py wrote for the toy tokenizer's data."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    recorded = json.loads(open(token_data + ".json").read())["vocabulary_hash"]
    assert model_vocabulary_hash(tok) == recorded
    assert token_data_problem(token_data, "--indexed", tok, toy_tokenizer) is None
    assert model_vocabulary_hash(_SlowTokenizer()) is None  # nothing to compare, not an AttributeError


def test_what_cannot_be_told_is_let_through(token_data, tmp_path):
    """A model tokenizer that differs (tiny WordLevel vocabulary) is refused only where both hashes are known."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    assert token_data_problem(token_data, "--indexed", other, "other").startswith(  # the control
        f"--indexed {token_data} was tokenized with another tokenizer")
    assert token_data_problem(token_data, "--indexed", _SlowTokenizer(), "slow") is None
    assert token_data_problem(token_data, "--indexed", None) is None
    # a manifest of an older version, without vocabulary_hash
    (tmp_path / "old").mkdir()
    old = _copy(token_data, tmp_path / "old")
    manifest = json.loads(open(old + ".json").read())
    del manifest["vocabulary_hash"]
    open(old + ".json", "w").write(json.dumps(manifest))
    assert token_data_problem(old, "--indexed", other, "other") is None
    # another pipeline's data: .bin/.idx and no manifest
    (tmp_path / "bare").mkdir()
    assert token_data_problem(_copy(token_data, tmp_path / "bare", with_manifest=False), "--calib", other) is None


def test_a_corrupt_manifest_names_the_flag(token_data, tmp_path):
    bad = _copy(token_data, tmp_path)
    open(bad + ".json", "w").write("{")
    assert token_data_problem(bad, "--calib").startswith(f"--calib: data prefix {bad}: {bad}.json is truncated")
