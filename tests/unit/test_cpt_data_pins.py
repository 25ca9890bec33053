"""Pins of data/cpt.py (mutation audit round 8): each test fails on one hand-made mutant of --upsample parsing,
--separator or prepare_cpt's bookkeeping that the older tests let through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.data import DataError
from megatron_ext.data.cpt import parse_upsample, prepare_cpt, separator_ids, upsample_rate


def _word_tokenizer(**special: str):
    """A tiny real Hugging Face fast tokenizer: whole words of a fixed vocabulary, split on whitespace, which it
    drops (a text of only spaces encodes to no token); `special` names its bos/eos/... tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **special)


def test_upsample_m_suffix_is_a_binary_million():
    """`gt1m` means more than 1024^2 tokens, like `k` means x1024 (the module docstring): 1,048,576 tokens keep
    rate 1, one more gets the rule's (CP1: m as 1000^2)."""
    rules = parse_upsample("gt1m=2")
    assert [upsample_rate(rules, "web", n) for n in (1_000_001, 1_048_576, 1_048_577)] == [1.0, 1.0, 2.0]


def test_bos_eos_separator_needs_both_tokens():
    """--separator bos-eos with a tokenizer that has an EOS but no BOS: the one-line error, not a document framed
    by a None id (CP10: refused only when both are missing)."""
    with pytest.raises(DataError, match=r"^--separator bos-eos: the tokenizer has no BOS/EOS token"):
        separator_ids(_word_tokenizer(eos_token="</s>"), "bos-eos")


def test_max_tokens_zero_is_refused(tmp_path: Path):
    """--max-tokens 0 is a mistake said at once ('must be positive'), not a dataset of one document (CP12: only
    negative numbers refused)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(DataError) as e:
        prepare_cpt([str(corpus)], str(tmp_path / "no_tokenizer_needed"), str(tmp_path / "out"), max_tokens=0,
                    progress=False)
    assert str(e.value) == "--max-tokens 0: must be positive"


def test_a_document_that_encodes_to_no_token_is_not_written(tmp_path: Path):
    """A document of only whitespace, which this tokenizer encodes to no token, writes nothing: no document made
    of the separator alone (two separators back to back in the stream) (CP15: only rate-0 documents skipped)."""
    tok_dir = tmp_path / "tok"
    _word_tokenizer().save_pretrained(str(tok_dir))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("hello world", "   \n ", "world")))
    manifest = prepare_cpt([str(corpus)], str(tok_dir), str(tmp_path / "out"), separator="hello", progress=False)
    assert (manifest["documents_read"], manifest["documents"], manifest["tokens"]) == (3, 2, 5)  # 2+1 and 1+1
