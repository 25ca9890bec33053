"""SFT data: assistant-only loss masks (decoded, and against transformers' own mask), packing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ext.data import SFTPackedDataset, collate_packed, pack_samples, prepare_sft, toy
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
    again = prepare_sft([str(path)], str(tok_dir), str(tmp_path / "sft2"), S, progress=False)
    assert again == man
    for suffix in (".bin", ".idx", "_lossmask.bin", "_lossmask.idx", ".json"):
        assert (tmp_path / f"sft{suffix}").read_bytes() == (tmp_path / f"sft2{suffix}").read_bytes()  # byte-identical


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
