"""RULER's one solved example before the vt and cwe questions (megatron_ext.evaluate.ruler_oneshot).

Read from the decoded prompt text alone, as a model sees it: the example is everything before the task's instruction
repeats. Its answer must be right for its own body (the chain followed, the words counted here), use no name or word
of the real task, and leave the prompt within its length. Sizes are NVIDIA/RULER's (variable_tracking.py: one chain
of 4 hops in a noise paragraph repeated within 500 tokens; common_words_extraction.py: 40 words, 10 of them 10 times
and the others 3 times, or at lengths under 4096 20 words, 10 of them 3 times and the others once).
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from megatron_ext.evaluate.haystack import builtin_haystack
from megatron_ext.evaluate.ruler import check_lengths
from megatron_ext.evaluate.ruler_tasks import _NOISE, TASKS, SampleBuilder, noise_haystack
from tests.unit.test_ruler import read_answer

LENGTHS = [1536, 4096, 12000]


@pytest.fixture(scope="module")
def tok(toy_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_tokenizer)


@pytest.fixture(scope="module")
def builder(tok):
    n = max(LENGTHS)
    return SampleBuilder(tok, {"filler": builtin_haystack(tok, n), "noise": noise_haystack(tok, n)})


def split_example(text: str) -> tuple[str, str, list[str], str]:
    """(the example's prompt up to its answer, its answer's items, the real task) of a decoded prompt; the example is
    what comes before the last copy of the prompt's first paragraph (the instruction)."""
    at = text.rindex(text.split("\n\n", 1)[0])
    example, real = text[:at], text[at:]
    assert example.endswith("\n\n"), "no solved example before the task"
    asked, answer = example[:-2].rsplit(" are:", 1)  # both answer prefixes end in "are:"
    return asked + " are:", answer.split(), real


@pytest.mark.parametrize("length", LENGTHS)
def test_vt_shows_one_solved_chain_of_other_names(tok, builder, length):
    noise_tokens = len(tok(" " + _NOISE, add_special_tokens=False)["input_ids"])
    for sample_no in range(3):
        sample = builder.build(TASKS["vt"], length, random.Random(f"1:vt:{length}:{sample_no}"))
        assert len(sample.ids) == length and sample.details["solved_example"]
        text = tok.decode(sample.ids, skip_special_tokens=True)
        asked, names, real = split_example(text)
        value = re.search(r"hold the value (\d+)", asked).group(1)
        # right for its own chain, in chain order: the value to the first name, each next name from the one before
        assert len(names) == 5 and f"VAR {names[0]} = {value}." in asked
        assert all(f"VAR {b} = VAR {a}." in asked for a, b in zip(names, names[1:]))
        assert sorted(names) == sorted(read_answer(asked).split(", "))  # the reader follows it to the same names
        # and nothing of the real task: other names, another value; the real task read alone is the real answer
        assert not set(names) & set(sample.answers) and not any(n in real for n in names)
        assert not any(n in asked for n in sample.answers)
        assert value != re.search(r"hold the value (\d+)", real).group(1)
        assert sorted(read_answer(text).split(", ")) == sorted(sample.answers)
        # RULER's size: the example's prompt (answer left out) within 500 tokens, short of it by less than a paragraph
        size = len(tok(asked, add_special_tokens=False)["input_ids"])
        assert 500 - noise_tokens - 2 < size <= 502, size


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_shows_one_solved_list_of_other_words(tok, builder, length):
    n_words, common, rare = (40, 10, 3) if length >= 4096 else (20, 3, 1)
    for sample_no in range(3):
        sample = builder.build(TASKS["cwe"], length, random.Random(f"1:cwe:{length}:{sample_no}"))
        assert 0.97 * length <= len(sample.ids) <= length and sample.details["solved_example"]
        text = tok.decode(sample.ids, skip_special_tokens=True)
        asked, answer, real = split_example(text)
        listed = Counter(re.findall(r"\d+\. (\w+)", asked.split("\n\n")[1]))
        assert sorted(listed.values()) == [rare] * (n_words - 10) + [common] * 10
        # its answer: "1. w 2. w ... 10. w", the example's own 10 most frequent words
        assert answer[::2] == [f"{i}." for i in range(1, 11)]
        assert set(answer[1::2]) == {w for w, _ in listed.most_common(10)}
        # no word of the example is in the real list, and the real task read alone is the real answer
        real_words = set(re.findall(r"\d+\. (\w+)", real))
        assert not set(listed) & real_words and not set(answer[1::2]) & set(sample.answers)
        assert sorted(read_answer(text).split(", ")) == sorted(sample.answers)


@pytest.mark.parametrize("name", ["vt", "cwe"])
def test_examples_are_one_per_seed(builder, name):
    a, b = (builder.build(TASKS[name], 4096, random.Random(f"0:{name}:a")) for _ in range(2))
    c = builder.build(TASKS[name], 4096, random.Random(f"0:{name}:b"))
    assert a.ids == b.ids and a.answers == b.answers and a.ids != c.ids


def test_lengths_too_short_for_the_example_leave_it_out(tok, builder):
    """The toy tokenizer's smallest vt prompt is 344 tokens and cwe's 719: the example does not fit at 400 / 800, so
    the prompt is the one without it (what these lengths gave before the examples), and the smallest length of each
    task is what it was (tiny models of 256 positions run vt at ~200 tokens in other tests)."""
    for name, length in [("vt", 400), ("cwe", 800)]:
        sample = builder.build(TASKS[name], length, random.Random(0))
        text = tok.decode(sample.ids, skip_special_tokens=True)
        assert not sample.details["solved_example"] and text.count(text.split("\n\n", 1)[0]) == 1
        assert len(sample.ids) <= length and sorted(read_answer(text).split(", ")) == sorted(sample.answers)
    check_lengths(tok, ["vt", "cwe"], [719, 1000, 1536, 4096], samples=2)  # the task lengths of the toy tokenizer
    assert builder.build(TASKS["vt"], 1000, random.Random(0)).details["solved_example"]


def test_chat_prompts_hold_the_example_in_the_user_turn(tok):
    from tests.unit.test_evaluate import CHAT_TEMPLATE

    tok.chat_template = CHAT_TEMPLATE
    try:
        chat = SampleBuilder(tok, {"noise": noise_haystack(tok, 4096)}, chat=True)
        text = tok.decode(chat.build(TASKS["vt"], 4096, random.Random(0)).ids)
    finally:
        tok.chat_template = None
    user, assistant = text.split("\n[assistant]\n")
    assert user.startswith("<s>[user]\nVariable assignments") and user.count("Variable assignments") == 2
    assert re.search(r"hold \d+ are:( [A-Z]+){5}\n\nVariable assignments", user)
    assert assistant.startswith("The variables that hold")


class _Scripted(random.Random):
    """A Random whose first `randrange` draws are given, then its own."""

    def __init__(self, first: list[int]):
        super().__init__(0)
        self.first = list(first)

    def randrange(self, *args, **kwargs):
        return self.first.pop(0) if self.first else super().randrange(*args, **kwargs)


def _words(s: str) -> int:
    """A stand-in token count that grows faster than its parts: a word each, and one more per 50 words."""
    n = len(s.split())
    return n + n // 50


def _names(n: int) -> list[str]:
    return ["ALPHA", "BRAVO", "CHARL", "DELTA", "ECHOO", "FOXTR"][:n]


def test_vt_example_fills_500_tokens_with_a_chain_in_order_and_another_value():
    """Hand numbers with `_words` as the token count: the example's prompt (answer left out) is the largest within
    RULER's 500 tokens, i.e. exactly 500 here (491 words); the per-paragraph estimate overshoots (508), so the
    trimming is what gets it there. The chain's lines come in chain order (RULER inserts them at sorted places).
    Its value is 5 digits (RULER's randint(10000, 99999)) and never the real task's, even when drawn twice."""
    from megatron_ext.evaluate.ruler_oneshot import vt_example

    text = vt_example(_Scripted([12345, 12345, 67890]), _names, "12345", 4, "grass.", _words)
    asked = text.rsplit(" are:", 1)[0] + " are:"
    assert _words(asked) == 500 and len(asked.split()) == 491
    assert "hold the value 67890" in asked and "12345" not in text
    at = [asked.index(f"VAR {n} = ") for n in _names(5)]
    assert at == sorted(at), at
    assert text.endswith(" are: ALPHA BRAVO CHARL DELTA ECHOO\n\n")
    values = {re.search(r"hold the value (\d+)", vt_example(random.Random(seed), _names, "12345", 4, "grass.",
                                                            _words)).group(1) for seed in range(100)}
    assert all(len(v) == 5 for v in values) and len(values) > 90


def test_cwe_example_list_is_shuffled():
    """RULER shuffles the example's words: the 10 common ones are not listed first, as a block."""
    from megatron_ext.evaluate.ruler_oneshot import cwe_example

    words = [f"w{i:02d}" for i in range(40)]
    text = cwe_example(random.Random(0), lambda n: words[:n], 4096, 10, "ten")
    listed = re.findall(r"\d+\. (w\d\d)", text.split("\n\n")[1])
    assert len(listed) == 10 * 10 + 30 * 3 and Counter(listed)["w00"] == 10
    assert set(listed[:100]) != set(words[:10])
