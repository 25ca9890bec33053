"""The demo's training texts (megatron_ext/demo/corpus.py) teach exactly what the NIAH evaluation asks: a 7-digit
needle anywhere in the filler (depth 0 to 100), key-value facts recalled after they are stated, the answer in the
evaluation's own words, and a tokenizer that splits digits, stops at Llama-3's turn end and has its chat format.
Pins the mutants of mutation audit round 8 (DC ids in the docstrings)."""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pytest

from megatron_ext.demo.corpus import TASK, build_demo_tokenizer, demo_chats, demo_corpus, needle_document

NEEDLE_HEAD = TASK.needle.split("{")[0]  # " The special magic number is "


def _haystack(doc: str) -> str:
    """The text between the instruction and the question: filler, facts and the needle."""
    return doc[len(TASK.instruction):doc.index(TASK.question)]


def _needle_value(doc: str) -> str:
    return re.search(re.escape(NEEDLE_HEAD.strip()) + r" (\d+)\.", _haystack(doc)).group(1)


def _filler_count(doc: str) -> int:
    """Filler sentences of a document without facts: every sentence ends with its only full stop."""
    return _haystack(doc).count(".") - 1  # the needle's own full stop


def test_needle_values_and_fact_codes_have_their_digit_counts():
    """The evaluation's needle is always 7 digits (copying it is 7 digit tokens), the facts' codes 4: a value drawn
    from 0 up (DC1) gave shorter ones, i.e. another task than the one scored."""
    for seed in range(200):
        doc = needle_document(random.Random(seed), 3, kv_facts=2)
        value = _needle_value(doc)
        assert len(value) == TASK.value_digits and value[0] != "0", doc
        assert doc.endswith(f"{TASK.answer_prefix} {value}."), doc[-80:]
        for code in re.findall(r"The code of the \w+ \w+ is (\d+)\.", doc):
            assert len(code) == 4 and code[0] != "0", doc


def test_every_fact_is_stated_before_it_is_asked():
    """Each key-value fact is stated before the question recalling it (recall, not guessing), and a document asked
    for 3 facts holds 3 (DC2: the recall drawn anywhere; DC3: the inserts swapped, the recall landing before its
    fact; DC23: one fact only)."""
    for seed in range(300):
        doc = needle_document(random.Random(seed), seed % 4, kv_facts=3)
        facts = re.findall(r"The code of the (\w+ \w+) is (\d+)\.", doc)
        assert len(facts) == 3, doc
        for key, code in facts:
            asked = f"Question: what is the code of the {key}? Answer: {code}."
            assert doc.index(f"The code of the {key} is {code}.") < doc.index(asked), doc


def test_the_needle_sits_at_every_depth_from_0_to_100():
    """The evaluation puts needles at depth 0 (first in the text) and 100 (last, right before the question): the
    training documents have both (DC4: never last, so depth 100 was never taught)."""
    places = Counter()
    for seed in range(200):
        hay = _haystack(needle_document(random.Random(seed), 3))
        places["first"] += hay.startswith(NEEDLE_HEAD)
        places["last"] += bool(re.search(re.escape(NEEDLE_HEAD) + r"\d+\.$", hay))
    assert places["first"] > 10 and places["last"] > 10, places


def test_no_answer_makes_the_evaluation_prompt():
    """`answer=False` gives the evaluation's prompt (ending in the question and the answer prefix); by default a
    document carries its answer (DC5: the CPT corpus without answers taught no retrieval; DC20: no question)."""
    prompt = needle_document(random.Random(7), 4, answer=False)
    assert prompt.endswith(TASK.question + TASK.answer_prefix), prompt[-120:]
    for doc in demo_corpus(10, seed=1, min_sentences=2, max_sentences=5):
        assert doc["text"].endswith(f"{TASK.question}{TASK.answer_prefix} {_needle_value(doc['text'])}.")


def test_the_corpus_ids_sources_and_facts():
    """Ids count from 0; every `kv_every`-th document (the first included) has 1-3 facts and is labelled
    needle-kv, the others none (DC6: the wrong documents, DC7: a kv document without facts, DC18: ids from 1,
    DC19: labels swapped)."""
    docs = list(demo_corpus(60, seed=3, min_sentences=2, max_sentences=6, kv_every=3))
    assert [d["id"] for d in docs] == list(range(60))
    for d in docs:
        facts = d["text"].count("The code of the ")
        if d["id"] % 3 == 0:
            assert d["source"] == "needle-kv" and 1 <= facts <= 3, d
        else:
            assert d["source"] == "needle" and facts == 0, d


def test_filler_lengths_span_min_to_max():
    """Filler sentences per document run from min to max inclusive, also with `length_power` (DC8: max never
    reached; DC9: u * power instead of u ** power, beyond max)."""
    counts = Counter(_filler_count(d["text"]) for d in demo_corpus(200, seed=5, min_sentences=2, max_sentences=4,
                                                                  kv_every=0, length_power=2.0))
    assert set(counts) == {2, 3, 4}, counts


def test_documents_have_their_own_filler():
    """Each document draws its own filler text (DC17: one seed for all, the same haystack every time): training
    and evaluation haystacks share a distribution, not their text."""
    hays = {re.sub(r"The special magic number is \d+\.", "", _haystack(d["text"]))
            for d in demo_corpus(20, seed=2, min_sentences=5, max_sentences=5, kv_every=0)}
    assert len(hays) == 20


def test_sft_chats_answer_in_the_evaluations_words():
    """A chat's user message is the document up to its question and the assistant says
    "The special magic number is 1234567." with the needle's value (DC10: "1234567.." with two full stops; DC11: the
    bare number), and chats reach max_sentences (DC21: randint up to max - 1, which fails for min == max)."""
    chats = list(demo_chats(30, seed=4, min_sentences=1, max_sentences=2))
    for chat in chats:
        user, assistant = (m["content"] for m in chat["messages"])
        assert user.endswith(TASK.question), user[-80:]
        assert assistant == f"{TASK.answer_prefix.strip()} {_needle_value(user + TASK.question)}.", assistant
    assert {_filler_count(c["messages"][0]["content"] + TASK.question) for c in chats} == {1, 2}
    (same,) = demo_chats(1, seed=4, min_sentences=3, max_sentences=3)
    assert _filler_count(same["messages"][0]["content"] + TASK.question) == 3


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_demo_tokenizer(Path(tmp_path_factory.mktemp("tok")))))


def test_the_demo_tokenizer_speaks_llama3_chat(demo_tokenizer):
    """The saved tokenizer stops generation at Llama-3's turn end <|eot_id|> (DC15: <|end_of_text|>, and SFT
    models ran past their answer), has the chat template the SFT models are asked in (DC14: none, and `--chat`
    failed), and adds no space before a text's first word (DC13: the prompt's first token changed)."""
    assert demo_tokenizer.eos_token == "<|eot_id|>"
    chat = demo_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert "<|start_header_id|>user<|end_header_id|>" in chat and chat.endswith("<|end_header_id|>\n\n")
    assert demo_tokenizer.decode(demo_tokenizer.encode("There is", add_special_tokens=False)) == "There is"
    assert not demo_tokenizer.tokenize("There")[0].startswith("Ġ")
