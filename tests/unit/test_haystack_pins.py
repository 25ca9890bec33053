"""Pins of `megatron_ext.evaluate.haystack` found by a mutation audit (round 6)."""

from __future__ import annotations

import hashlib
import itertools

from megatron_ext.evaluate.haystack import _SENTENCE_END, file_haystack, filler_sentences, tokenize_haystack
from tests.unit.test_evaluate import make_tokenizer


def test_sentences_ending_in_exclamation_marks_or_closing_quotes_end_there():
    """The documented sentence ends: . ! ? then optional closing quotes/brackets, then whitespace. An essay's
    `"Stop!" she said.` ends after the quote, and `Go!` ends a sentence as `Go.` does (the built-in filler has
    neither: only a --haystack text shows it)."""
    text = 'Go! He said "Stop." Then (why?) she left. Quote \u201cdone.\u201d Next'
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    want = ['Go!', '"Stop."', '(why?)', 'she left.', '\u201cdone.\u201d']
    assert len(ends) == len(want) and all(text[:e].endswith(w) for e, w in zip(ends, want)), ends


def test_a_needle_slot_follows_an_exclamation_mark():
    """In the token stream a sentence after "!" is a needle slot, as one after "." is (the tiny tokenizer has every
    filler word; its first token there is the sentence's first word with the space before it)."""
    tok = make_tokenizer()
    pieces = ["The river passes the garden near the hill!", " The old farmer watches the cart.", " A road"]
    hay = tokenize_haystack(tok, ["".join(pieces)], 10, "t")
    first = len(tok(pieces[0], add_special_tokens=False)["input_ids"])
    second = first + len(tok(pieces[1], add_special_tokens=False)["input_ids"])
    assert hay.starts.tolist() == [0, first, second]


def test_file_haystack_digest_is_the_files_own_sha256(tmp_path):
    """`haystack_sha256` is the sha256 of the file as it is on disk (what `sha256sum` prints), not of the text with
    the caller's `lead` put before it."""
    path = tmp_path / "essays.txt"
    path.write_text(" ".join(itertools.islice(filler_sentences(2), 300)), encoding="utf-8")
    hay = file_haystack(make_tokenizer(), path, 500, lead=" ")
    assert hay.digest == hashlib.sha256(path.read_bytes()).hexdigest()
