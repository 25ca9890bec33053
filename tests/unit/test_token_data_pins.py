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


def test_the_refusal_says_the_data_s_vocabulary_then_the_model_s(token_data, toy_tokenizer):
    """Another tokenizer's data: the data's tokenizer and vocabulary (its manifest's) first, then the model's (as
    prepare_data.py would record it), and the --tokenizer to prepare the data again with; without a name, words
    in its place, not 'None' (mutation audit round 9)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.data.common import tokenizer_vocabulary_hash

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    data = json.loads(open(token_data + ".json").read())["vocabulary_hash"][:len("sha256:") + 12]
    model = tokenizer_vocabulary_hash(other)[:len("sha256:") + 12]
    assert data != model
    assert token_data_problem(token_data, "--indexed", other, "runs/tok") == (
        f"--indexed {token_data} was tokenized with another tokenizer ({toy_tokenizer}, vocabulary {data}) than the "
        f"model's (runs/tok, vocabulary {model}); prepare it again with --tokenizer runs/tok (tools/prepare_data.py "
        "cpt)")
    unnamed = token_data_problem(token_data, "--calib", other)
    assert f"than the model's (the model's tokenizer, vocabulary {model}); prepare it again" in unnamed
    assert "None" not in unnamed
