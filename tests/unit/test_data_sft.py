"""SFT data: assistant-only loss masks (decoded, and against transformers' own mask), packing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ext.data import DataError, SFTPackedDataset, collate_packed, pack_samples, prepare_sft, toy
from megatron_ext.data.chat import LLAMA31_CHAT_TEMPLATE, tokenize_chat


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return toy.build_toy_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of ones."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_masks_cover_exactly_assistant_spans(hf_tok):
    chats = [c["messages"] for c in toy.synthetic_chats(12, seed=4)]
    for messages in chats:
        ids, mask = tokenize_chat(hf_tok, messages, LLAMA31_CHAT_TEMPLATE)
        decoded = [hf_tok.decode(ids[a:b]) for a, b in _runs(mask)]
        want = [m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
        assert decoded == want
        assert hf_tok.decode(ids) == hf_tok.apply_chat_template(messages, tokenize=False)
        # independent oracle: transformers' {% generation %}-based assistant mask
        ref = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
    # negative control: user text never lands in the mask
    ids, mask = tokenize_chat(hf_tok, chats[0], LLAMA31_CHAT_TEMPLATE)
    assert "What is the code" not in hf_tok.decode([t for t, m in zip(ids, mask) if m])


def test_llama31_rendering_is_metas_prompt_format(hf_tok):
    """The built-in template against Meta's Llama-3.1 prompt format written out by hand (the toy tokenizer's own
    chat_template is the built-in one, so apply_chat_template is no oracle for the text): <|begin_of_text|>, the
    system block with the knowledge date always there (empty without a system message), the contents trimmed,
    '<|end_header_id|>\\n\\n' before each, the generation prompt a served model gets. Only the reply and its
    <|eot_id|> are trained."""
    head = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n" \
           "Today Date: 26 Jul 2024\n\n"
    messages = [{"role": "system", "content": " Be brief.\n"}, {"role": "user", "content": "\nWhat is two and two? "},
                {"role": "assistant", "content": "  Four.\n"}]
    prompt = head + "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is two and two?<|eot_id|>" \
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ids, mask = tokenize_chat(hf_tok, messages, LLAMA31_CHAT_TEMPLATE)
    assert hf_tok.decode(ids) == prompt + "Four.<|eot_id|>"
    assert [hf_tok.decode(ids[a:b]) for a, b in _runs(mask)] == ["Four.<|eot_id|>"]
    assert hf_tok.apply_chat_template(messages[:2], chat_template=LLAMA31_CHAT_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True) == prompt
    ids, _ = tokenize_chat(hf_tok, messages[1:], LLAMA31_CHAT_TEMPLATE)
    assert hf_tok.decode(ids) == head + prompt[prompt.index("<|eot_id|>"):] + "Four.<|eot_id|>"


def test_custom_template_spans(hf_tok):
    """A template that renders a prefix of the conversation differently from the whole (here: a marker before the
    last message) has no well-defined assistant spans: DataError, not a silently wrong mask. Replies rendered
    back to back (a headerless template) are both trained, the second from its first token."""
    unstable = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "r"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(DataError, match="not prefix-stable"):
        tokenize_chat(hf_tok, chat, unstable)
    bare = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    ids, mask = tokenize_chat(hf_tok, [chat[0], chat[1], {"role": "assistant", "content": "b"}], bare)
    assert [hf_tok.decode(ids[a:b]) for a, b in _runs(mask)] == ["a<|eot_id|>b<|eot_id|>"]
    assert hf_tok.decode([t for t, m in zip(ids, mask) if not m]) == "q<|eot_id|>"


def test_prepare_sft_drops_and_counts(tmp_path, tok_dir, hf_tok):
    chats = list(toy.synthetic_chats(30, seed=2, no_assistant_every=5))
    chats.append({"messages": "not a list"})
    path = toy.write_jsonl(tmp_path / "s.jsonl", chats)
    S = 256
    lens = [len(tokenize_chat(hf_tok, c["messages"], LLAMA31_CHAT_TEMPLATE)[0]) for c in chats[:30]
            if any(m["role"] == "assistant" for m in c["messages"])]
    man = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "sft"), S, progress=False)
    assert man["dropped"] == {"no_assistant_turn": 6, "too_long": sum(n > S for n in lens), "bad_messages": 1}
    assert man["samples"] == sum(n <= S for n in lens) and man["samples"] > 0
    assert man["dropped"]["too_long"] > 0  # the length filter is exercised
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    toks, masks = IndexedDataset(str(tmp_path / "sft")), IndexedDataset(str(tmp_path / "sft_lossmask"))
    assert np.array_equal(toks.sequence_lengths, masks.sequence_lengths)
    assert int(toks.sequence_lengths.max()) <= S
    assert man["trained_tokens"] == sum(int(masks[i].sum()) for i in range(len(masks)))
    # the manifest's counts against the written files and the tokenizer (mutants of each survived before)
    assert man["documents"] == len(toks) == man["samples"] and man["tokens"] == int(toks.sequence_lengths.sum())
    assert man["max_token_id"] == max(int(toks[i].max()) for i in range(len(toks)))  # not the last token's (eot)
    assert man["pad_id"] == hf_tok.pad_token_id != hf_tok.eos_token_id  # the pad token, not EOS
    n_packs = len(pack_samples(toks.sequence_lengths, S))
    assert man["packs"] == n_packs and man["pack_fill"] == round(man["tokens"] / (n_packs * S), 6)
    again = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "sft2"), S, progress=False)
    assert again == man
    for suffix in (".bin", ".idx", "_lossmask.bin", "_lossmask.idx", ".json"):
        assert (tmp_path / f"sft{suffix}").read_bytes() == (tmp_path / f"sft2{suffix}").read_bytes()  # byte-identical


def test_max_token_id_covers_the_pad_id(tmp_path, tok_dir, hf_tok):
    """The loader pads packs with pad_id, so the manifest's max_token_id (which the trainer checks against the
    model's vocabulary) covers it when it is above every id in the data: here a pad token of id 511."""
    hf_tok.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    tok.pad_token = tok.convert_ids_to_tokens(len(tok) - 1)
    tok.save_pretrained(tmp_path / "tok")
    path = toy.write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}]}])
    man = prepare_sft([str(path)], str(tmp_path / "tok"), str(tmp_path / "sft"), 256, progress=False)
    ids = tokenize_chat(hf_tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                        LLAMA31_CHAT_TEMPLATE)[0]
    assert man["pad_id"] == len(tok) - 1 > max(ids) and man["max_token_id"] == man["pad_id"]


def test_pack_samples_never_splits():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=500)
    packs = pack_samples(lengths, 512, seed=3)
    flat = sorted(i for p in packs for i in p)
    assert flat == list(range(500))  # every sample exactly once, whole
    assert all(lengths[p].sum() <= 512 for p in packs)
    assert len(packs) <= 1.15 * lengths.sum() / 512 + 1  # best-fit packs tightly
    assert packs == pack_samples(lengths, 512, seed=3)  # deterministic
    assert packs != pack_samples(lengths, 512, seed=4)
    with pytest.raises(ValueError):
        pack_samples(np.array([513]), 512)
    assert all(p == sorted(p) for p in packs)  # the docstring's promise: index order inside each pack


@pytest.mark.parametrize("lengths, seq_length, packs", [
    ([4, 4], 8, [[0, 1]]),  # an exact fit fills the pack
    ([5, 3, 4, 4], 8, [[0, 1], [2, 3]]),  # the two 4s fill a pack, so 3 joins 5
    ([8], 8, [[0]]),  # a sample of exactly seq_length
    ([6, 5, 3, 2], 8, [[0, 3], [1, 2]]),
])
def test_pack_samples_best_fit_by_hand(lengths, seq_length, packs):
    """Best-fit decreasing worked out by hand: each sample, longest first, into the pack with the least room that
    still holds it, an exact fit included."""
    assert sorted(pack_samples(np.array(lengths), seq_length, seed=0)) == packs


def test_packed_dataset_batches(tmp_path, tok_dir, hf_tok):
    chats = list(toy.synthetic_chats(40, seed=6))
    path = toy.write_jsonl(tmp_path / "s.jsonl", chats)
    S = 512
    prepare_sft([str(path)], str(tok_dir), str(tmp_path / "sft"), S, progress=False)
    ds = SFTPackedDataset(str(tmp_path / "sft"), S, seed=1)
    samples = {}
    for c in chats:
        ids, mask = tokenize_chat(hf_tok, c["messages"], LLAMA31_CHAT_TEMPLATE)
        if len(ids) <= S:
            samples.setdefault(tuple(ids), mask)
    seen = 0
    for k in range(len(ds)):
        b = ds[k]
        assert all(b[x].shape == (S,) for x in ("tokens", "labels", "loss_mask", "position_ids"))
        cu = b["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == S and cu == sorted(cu)
        n = int(b["num_samples"])
        for j in range(len(cu) - 1):
            a, e = cu[j], cu[j + 1]
            seg = tuple(b["tokens"][a:e].tolist())
            assert b["position_ids"][a:e].tolist() == list(range(e - a))  # reset per sample
            if j >= n:  # padding tail: never trained
                assert (b["loss_mask"][a:e] == 0).all() and set(seg) == {ds.pad_id}
                continue
            assert seg in samples  # a whole conversation: packing never splits one
            mask = samples[seg]
            assert b["labels"][a:e - 1].tolist() == list(seg[1:])
            assert b["loss_mask"][a:e - 1].tolist() == [float(m) for m in mask[1:]]
            assert b["loss_mask"][e - 1] == 0  # no target across the boundary
            seen += 1
    assert seen == ds.manifest["samples"]
    batch = collate_packed([ds[0], ds[1]])
    assert batch["tokens"].shape == (2, S) and batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].shape[1] == max(ds[0]["cu_seqlens"].numel(), ds[1]["cu_seqlens"].numel())
    assert batch["max_seqlen"].shape == (2,)
    # packs of different sample counts: the shorter cu_seqlens row is padded with -1 (not 0, a real boundary)
    short, long_ = sorted(range(len(ds)), key=lambda k: ds[k]["cu_seqlens"].numel())[::len(ds) - 1]
    a, b = ds[short]["cu_seqlens"], ds[long_]["cu_seqlens"]
    assert a.numel() < b.numel()
    cu = collate_packed([ds[short], ds[long_]])["cu_seqlens"]
    assert cu[0].tolist() == a.tolist() + [-1] * (b.numel() - a.numel()) and cu[1].tolist() == b.tolist()
    assert collate_packed([ds[short], ds[long_]])["max_seqlen"].tolist() == \
        [int((x[1:] - x[:-1]).max()) for x in (a, b)]


def test_conversation_of_exactly_seq_length_is_kept(tmp_path, tok_dir, hf_tok):
    """Read at seq_length = one conversation's own token count (from the tokenizer): it is kept, alone in a pack it
    fills with no padding segment; only the longer ones are left out."""
    chats = list(toy.synthetic_chats(12, seed=6))
    path = toy.write_jsonl(tmp_path / "s.jsonl", chats)
    prepare_sft([str(path)], str(tok_dir), str(tmp_path / "sft"), 4096, progress=False)
    lengths = sorted(len(tokenize_chat(hf_tok, c["messages"], LLAMA31_CHAT_TEMPLATE)[0]) for c in chats)
    S = lengths[len(lengths) // 2]
    assert lengths.count(S) == 1 and lengths[-1] > S  # one conversation that long; longer ones exist
    with pytest.warns(UserWarning, match=f"{sum(n > S for n in lengths)} conversations longer than seq_length"):
        ds = SFTPackedDataset(str(tmp_path / "sft"), S, seed=1)
    assert ds.dropped == sum(n > S for n in lengths)
    full = [k for k in range(len(ds)) if ds[k]["cu_seqlens"].tolist() == [0, S]]
    assert len(full) == 1 and int(ds[full[0]]["num_samples"]) == 1
    assert sum(int(ds[k]["num_samples"]) for k in range(len(ds))) == sum(n <= S for n in lengths)


def test_chat_template_options(tmp_path, tok_dir):
    path = toy.write_jsonl(tmp_path / "s.jsonl", toy.synthetic_chats(5, seed=1))
    a = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "a"), 1024, chat_template="llama3.1", progress=False)
    b = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "b"), 1024, chat_template="tokenizer", progress=False)
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
    c = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "c"), 1024, chat_template=str(tpl), progress=False)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes() and b["tokens"] == a["tokens"]
    assert c["tokens"] < a["tokens"] and c["trained_tokens"] == a["trained_tokens"]  # same assistant spans


def test_tool_messages_use_llama31_ipython_header(hf_tok):
    """Llama-3.1's template renders `tool` results under the `ipython` header; the built-in one wrote a `tool`
    header the model never saw (prepare_sft keeps Llama-3.1's roles: system, user, assistant, tool, ipython). Their
    content is JSON, as Meta's template writes it (its `is iterable` test holds for a string): in quotes, not
    trimmed, non-ASCII kept (the built-in one wrote it bare and trimmed)."""
    messages = [{"role": "user", "content": "What is the code of the cat?"},
                {"role": "assistant", "content": "Let me look it up."},
                {"role": "tool", "content": " cat: 42 \u00e9"},
                {"role": "assistant", "content": "The code of the cat is 42."}]
    ids, mask = tokenize_chat(hf_tok, messages, LLAMA31_CHAT_TEMPLATE)
    text = hf_tok.decode(ids)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n" cat: 42 \u00e9"<|eot_id|>' in text and ">tool<" not in text
    assert [hf_tok.decode(ids[a:b]) for a, b in _runs(mask)] == ["Let me look it up.<|eot_id|>",
                                                                 "The code of the cat is 42.<|eot_id|>"]
    ref = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])


def _acemath_rows(n: int, seed: int) -> list[dict]:
    """Rows shaped as AceMath-Instruct's (the paper's SFT source): the prompt turns in `messages`, the final reply
    apart in `answer`; every third row is multi-turn (its earlier replies are in `messages`)."""
    rows = []
    for i, chat in enumerate(toy.synthetic_chats(n, seed=seed)):
        msgs = [m for m in chat["messages"] if m["role"] != "system"]
        last = max(j for j, m in enumerate(msgs) if m["role"] == "assistant")
        prompt = msgs[:last]
        if i % 3 == 0:
            prompt = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "first reply"},
                      *prompt]
        rows.append({"messages": prompt, "answer": msgs[last]["content"], "category": "general"})
    return rows


def test_answer_field_becomes_the_last_assistant_turn(tmp_path, tok_dir, hf_tok, capsys):
    """AceMath-shaped rows: with --answer-field each sample is the messages plus the answer as the last assistant
    turn, masked as such (compared with rendering that conversation directly); without it the single-turn rows
    are dropped and the multi-turn ones kept with their final reply missing, which the warning names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _acemath_rows(12, seed=3)
    path = tmp_path / "acemath.parquet"  # AceMath ships parquet
    pq.write_table(pa.Table.from_pylist(rows), path)
    man = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "with"), 4096, answer_field="answer",
                      progress=False)
    assert man["samples"] == 12 and man["dropped"] == {"no_assistant_turn": 0, "too_long": 0, "bad_messages": 0}
    assert man["ends_with_prompt"] == 0 and man["settings"]["answer_field"] == "answer"
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    toks, masks = IndexedDataset(str(tmp_path / "with")), IndexedDataset(str(tmp_path / "with_lossmask"))
    for i, row in enumerate(rows):
        conv = [*row["messages"], {"role": "assistant", "content": row["answer"]}]
        ids, mask = tokenize_chat(hf_tok, conv, LLAMA31_CHAT_TEMPLATE)
        assert toks[i].tolist() == ids and masks[i].tolist() == mask
        last_run = _runs(mask)[-1]
        assert hf_tok.decode(ids[last_run[0]:last_run[1]]).startswith(row["answer"])  # the answer is trained on
    capsys.readouterr()

    man = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "without"), 4096, progress=False)
    multi = [any(m["role"] == "assistant" for m in r["messages"]) for r in rows]
    assert 4 <= sum(multi) < 12  # every third row at least, not all
    assert man["dropped"]["no_assistant_turn"] == 12 - sum(multi) and man["samples"] == man["ends_with_prompt"] == sum(multi)
    err = capsys.readouterr().err
    assert f"{sum(multi)} kept samples end with a user or tool turn" in err and "pass --answer-field answer" in err
    # a tool's result as the last turn: the reply that uses it is missing too (it was kept without a word)
    tool_last = [{"role": "user", "content": "Look up the cat."}, {"role": "assistant", "content": "Looking."},
                 {"role": "tool", "content": "cat: 42"}]
    man = prepare_sft([str(toy.write_jsonl(tmp_path / "tool.jsonl", [{"messages": tool_last}]))], str(tok_dir),
                      str(tmp_path / "tool"), 4096, progress=False)
    assert man["samples"] == man["ends_with_prompt"] == 1
    assert "1 kept samples end with a user or tool turn" in capsys.readouterr().err

    only_single = tmp_path / "single.jsonl"
    toy.write_jsonl(only_single, [r for r, m in zip(rows, multi) if not m])
    with pytest.raises(DataError, match="no usable SFT samples.*pass --answer-field answer"):
        prepare_sft([str(only_single)], str(tok_dir), str(tmp_path / "none"), 4096, progress=False)
    with pytest.raises(DataError, match="no field 'reply'.*--answer-field"):
        prepare_sft([str(path)], str(tok_dir), str(tmp_path / "none"), 4096, answer_field="reply", progress=False)
    bad = tmp_path / "bad.jsonl"
    # a null answer; and turns that end with a reply already (a solution, its final answer beside it): two replies
    # in a row would be trained, so the row is dropped and named
    answered = {"messages": [*rows[3]["messages"], {"role": "assistant", "content": "the whole solution"}],
                "answer": "4"}
    toy.write_jsonl(bad, [answered, {**rows[1], "answer": None}, rows[2]])
    man = prepare_sft([str(bad)], str(tok_dir), str(tmp_path / "bad"), 4096, answer_field="answer", progress=False)
    assert man["dropped"]["bad_messages"] == 2 and man["samples"] == 1
    err = capsys.readouterr().err
    assert "two replies in a row" in err and err.count("sample skipped") == 1  # the first skip is named, only it
    from megatron_ext.data.sft import _row_turns

    assert _row_turns({**rows[1], "answer": None}, "x:2", None, "answer").problem == \
        "'answer' is a NoneType, not a string"
    # rows that end with their reply and also hold an 'answer' (all too long here): no --answer-field advice
    with pytest.raises(DataError, match="too long") as e:
        prepare_sft([str(toy.write_jsonl(tmp_path / "answered.jsonl", [answered]))], str(tok_dir),
                    str(tmp_path / "none"), 8, progress=False)
    assert "--answer-field" not in str(e.value)
    long_prompt = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                {"role": "user", "content": "word " * 3000}]}
    man = prepare_sft([str(toy.write_jsonl(tmp_path / "long.jsonl", [long_prompt, rows[1] | {"messages":
                      [*rows[1]["messages"], {"role": "assistant", "content": rows[1]["answer"]}]}]))],
                      str(tok_dir), str(tmp_path / "long"), 512, progress=False)
    assert man["dropped"]["too_long"] == 1 and man["ends_with_prompt"] == 0  # counted only among the kept


def test_max_samples_draws_rows_uniformly(tmp_path, tok_dir):
    """--max-samples keeps k rows in input order, the same for a seed; over many seeds every row is drawn about
    k/n of the time (a draw biased to the first or last rows fails), and k >= n keeps them all."""
    from megatron_ext.data.sft import _sample_rows

    items = [("in", f"row {i}", {"i": i}) for i in range(20)]
    counts = np.zeros(20)
    for seed in range(400):
        picked = [row["i"] for _, _, row in _sample_rows(iter(items), 5, seed, progress=False)[0]]
        assert len(picked) == 5 and picked == sorted(set(picked))
        counts[picked] += 1
    assert counts.min() > 60 and counts.max() < 140, counts  # expected 100 each; binomial sd 8.7
    assert [r["i"] for _, _, r in _sample_rows(iter(items), 50, 0, progress=False)[0]] == list(range(20))
    # one of two rows: each about half the time (an off-by-one draw, j in [0, i), always took the second)
    firsts = sum(_sample_rows(iter(items[:2]), 1, seed, progress=False)[0][0][2]["i"] == 0 for seed in range(200))
    assert 70 < firsts < 130, firsts  # expected 100; sd 7

    chats = list(toy.synthetic_chats(30, seed=5))
    path = toy.write_jsonl(tmp_path / "c.jsonl", chats)
    a = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "a"), 4096, max_samples=10, progress=False)
    b = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "b"), 4096, max_samples=10, progress=False)
    c = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "c"), 4096, max_samples=10, seed=7, progress=False)
    assert a == b and c["samples"] == 10 and c["settings"]["seed"] == 7
    assert a["samples_read"] == 10 and a["samples"] == 10 and a["settings"]["max_samples"] == 10
    assert a["rows_in_input"] == 30
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert (tmp_path / "a.bin").read_bytes() != (tmp_path / "c.bin").read_bytes()
    with pytest.raises(DataError, match="--max-samples 0: must be a positive"):
        prepare_sft([str(path)], str(tok_dir), str(tmp_path / "d"), 4096, max_samples=0, progress=False)


def test_progress_in_a_log_file_is_plain_lines(tmp_path, tok_dir, capsys, monkeypatch):
    """stderr a file (a Slurm log): the bars' '\\r' redraws piled up on one line. Now each update is a line of its
    own; with --max-samples the rows drawn are the total, so the lines give the percentage."""
    from megatron_ext import progress

    monkeypatch.setattr(progress, "LOG_PROGRESS_SECONDS", 0.0)
    path = toy.write_jsonl(tmp_path / "c.jsonl", list(toy.synthetic_chats(30, seed=5)))
    prepare_sft([str(path)], str(tok_dir), str(tmp_path / "a"), 4096, max_samples=10)
    err = capsys.readouterr().err
    assert "\r" not in err and err.startswith(f"sft: loading tokenizer {tok_dir}\n"), err
    lines = err.splitlines()
    assert "sft: drawing rows: 30row [" in err and "sft: drew 10 of 30 rows" in err, err
    assert [ln.split("|")[0] for ln in lines if ln.startswith("sft: ") and "sample/s" in ln] == \
        [f"sft: {p:3d}%" for p in range(0, 101, 10)] + ["sft: 100%"], err  # the last: the bar's close


def test_sharegpt_rows_read_as_messages(tmp_path, tok_dir, capsys):
    """ShareGPT's form ({"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}, as ShareGPT and
    SlimOrca, two of the paper's SFT components, store it) gives byte for byte the dataset of the same chats as
    {role, content} messages; a speaker name outside the mapping is named as an unknown role."""
    chats = list(toy.synthetic_chats(20, seed=6))
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    share = [{"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in c["messages"]]}
             for c in chats]
    a = prepare_sft([str(toy.write_jsonl(tmp_path / "m.jsonl", chats))], str(tok_dir), str(tmp_path / "m"), 4096,
                    progress=False)
    b = prepare_sft([str(toy.write_jsonl(tmp_path / "s.jsonl", share))], str(tok_dir), str(tmp_path / "s"), 4096,
                    progress=False)
    assert b["sharegpt_rows"] == 20 and a["sharegpt_rows"] == 0 and a["samples"] == b["samples"] == 20
    for suffix in (".bin", ".idx", "_lossmask.bin", "_lossmask.idx"):
        assert (tmp_path / f"m{suffix}").read_bytes() == (tmp_path / f"s{suffix}").read_bytes()
    share[1]["conversations"][0]["from"] = ["human"]  # not a name: a malformed row, counted (was a TypeError)
    share[0]["conversations"][0]["from"] = "bing"
    c = prepare_sft([str(toy.write_jsonl(tmp_path / "b.jsonl", share))], str(tok_dir), str(tmp_path / "b"), 4096,
                    progress=False)
    assert c["dropped"]["bad_messages"] == 2 and "role 'bing' is not one of" in capsys.readouterr().err
    assert c["messages_fields_read"] == {"conversations": 20} and a["messages_fields_read"] == {"messages": 20}
    # tool results under ShareGPT's names are `tool` turns (Llama-3.1's ipython header); a row with both fields is
    # read from `messages`; turns that have a role are {role, content} ones, whatever else they carry
    msgs = [{"role": "user", "content": "Look up the cat."}, {"role": "assistant", "content": "Looking."},
            {"role": "tool", "content": "cat: 42"}, {"role": "assistant", "content": "It is 42."}]
    rows = [{"messages": msgs}, {"messages": msgs}]
    share = [{"conversations": [{"from": name, "value": m["content"]} for name, m in
                                zip(["human", "gpt", tool, "gpt"], msgs)]} for tool in ("observation", "function_response")]
    share.append({"messages": msgs, "conversations": [{"from": "human", "value": "other"}, {"from": "gpt", "value": "x"}]})
    rows.append({"messages": msgs})
    share.append({"messages": [{**m, "from": "gpt", "value": "other"} for m in msgs]})
    rows.append({"messages": msgs})
    a = prepare_sft([str(toy.write_jsonl(tmp_path / "m2.jsonl", rows))], str(tok_dir), str(tmp_path / "m2"), 4096,
                    progress=False)
    b = prepare_sft([str(toy.write_jsonl(tmp_path / "s2.jsonl", share))], str(tok_dir), str(tmp_path / "s2"), 4096,
                    progress=False)
    assert b["samples"] == 4 and b["sharegpt_rows"] == 2
    assert b["messages_fields_read"] == {"conversations": 2, "messages": 2}
    for suffix in (".bin", "_lossmask.bin"):
        assert (tmp_path / f"m2{suffix}").read_bytes() == (tmp_path / f"s2{suffix}").read_bytes()
