"""Pins of data/toy.py (mutation audit round 8): each test fails on one hand-made mutant of the offline toy
tokenizer, corpus or chats that the older tests let through."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from megatron_ext.data import toy


def test_toy_inputs_tokenizer_and_chats(tmp_path: Path):
    """`prepare_data.py toy`'s outputs: the tokenizer's BOS/EOS are Llama-3.1-Instruct's (<|begin_of_text|>, and
    <|eot_id|>, where a chat reply stops; TY3: <|end_of_text|>), its folder has the mode a plain mkdir gives under
    the umask, not mkdtemp's 0700 (TY5), and chats.jsonl holds the chats of the seed asked for (TY17: seed 0)."""
    from transformers import AutoTokenizer

    old_umask = os.umask(0o022)
    try:
        out = toy.write_toy_inputs(tmp_path / "toy", documents=2, chats=3, seed=3)
    finally:
        os.umask(old_umask)
    tok = AutoTokenizer.from_pretrained(str(out["tokenizer"]))
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert out["tokenizer"].stat().st_mode & 0o777 == 0o755
    chats = [json.loads(line) for line in out["chats"].read_text().splitlines()]
    assert chats == list(toy.synthetic_chats(3, seed=3)) != list(toy.synthetic_chats(3, seed=0))


def test_tokenizer_rebuilt_over_an_existing_folder(tmp_path: Path):
    """Building the toy tokenizer into a folder that holds an older one replaces it whole: the new files, none of the
    old folder's (TY6: the old folder not removed, so the rename onto it fails)."""
    out = tmp_path / "tok"
    out.mkdir()
    (out / "stale.txt").write_text("from an older build")
    toy.build_toy_tokenizer(out)
    assert (out / "tokenizer.json").is_file() and not (out / "stale.txt").exists()


def test_a_failed_build_leaves_no_staging_folder(tmp_path: Path):
    """A build that cannot be renamed into place (the output path is a file) raises and leaves no hidden staging
    folder beside it (TY7: the staging folder kept)."""
    out = tmp_path / "tok"
    out.write_text("a file, not a tokenizer folder")
    with pytest.raises(OSError):
        toy.build_toy_tokenizer(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_documents_state_two_facts_in_sentences_of_twelve_words():
    """Each synthetic document states two facts and asks for both later (TY10: one fact), and its filler is
    sentences of 12 words, each ending with a capitalized word and a period (TY9: the first word marked)."""
    import random

    for doc in toy.synthetic_corpus(6, seed=2):
        facts = re.findall(r"The code of the (\w+ \w+) is (\d+)\.", doc["text"])
        asked = re.findall(r"Question: what is the code of the (\w+ \w+)\? Answer: (\d+)\.", doc["text"])
        assert len(facts) == 2 and asked == facts, doc["text"]
    words = toy._filler(random.Random(0), 24).split(" ")
    assert [i for i, w in enumerate(words) if w.endswith(".")] == [11, 23]
    assert words[11][0].isupper() and words[0].islower()


def test_every_kth_chat_has_no_assistant_turn_and_keeps_the_rest():
    """With no_assistant_every=3 the 3rd and 6th samples (not the 1st and 4th; TY15) lose their assistant turns
    and keep everything else, a system prompt included (TY22: only user turns kept); the other samples are as
    without the option. Some samples have a system prompt, some not (TY16: never)."""
    plain = list(toy.synthetic_chats(6, seed=3))
    dropped = list(toy.synthetic_chats(6, seed=3, no_assistant_every=3))
    for i, (p, d) in enumerate(zip(plain, dropped)):
        want = [m for m in p["messages"] if m["role"] != "assistant"] if i in (2, 5) else p["messages"]
        assert d["messages"] == want, i
    assert any(plain[i]["messages"][0]["role"] == "system" for i in (2, 5))  # the system prompt case is exercised
    systems = [c["messages"][0]["role"] == "system" for c in toy.synthetic_chats(20, seed=0)]
    assert any(systems) and not all(systems)
