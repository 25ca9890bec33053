"""megatron_ext.evaluate.run_settings on what the resume tests do not try (mutation audit round 7): results of an
older version without a haystack hash are resumed, not refused; a tokenizer made in memory records no name; the
tokenizer refusal gives each side its own digest."""

import pytest

from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate.run_settings import refuse_other_numerics, refuse_other_prompts, tokenizer_settings
from tests.unit.test_evaluate import make_tokenizer


def test_a_haystack_hash_is_compared_only_where_the_earlier_results_have_one():
    now = {"haystack": "book.txt", "haystack_sha256": "ab" * 32}
    refuse_other_prompts({"haystack": "book.txt"}, now, ("haystack",))  # older results: no hash recorded
    with pytest.raises(EvalError, match="^the earlier results were made with haystack_sha256 = 'cd"):
        refuse_other_prompts({"haystack": "book.txt", "haystack_sha256": "cd" * 32}, now, ("haystack",))


def test_a_tokenizer_without_a_name_records_none():
    tok = make_tokenizer()  # built in memory: name_or_path is ''
    assert tok.name_or_path == ""
    settings = tokenizer_settings(tok)
    assert settings["tokenizer"] is None and len(settings["tokenizer_sha256"]) == 64


def test_the_tokenizer_refusal_says_old_then_new():
    old = {"tokenizer": "a", "tokenizer_sha256": "1" * 64}
    with pytest.raises(EvalError) as e:
        refuse_other_numerics(old, {"tokenizer": "b", "tokenizer_sha256": "2" * 64})
    assert str(e.value) == ("--resume: the earlier cells were tokenized by another tokenizer, a (sha256 111111111111) "
                            "-> b (sha256 222222222222): resume with --tokenizer a, or use another --out")
