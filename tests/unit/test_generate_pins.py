"""Pins of `megatron_ext.evaluate.generate` found by a mutation audit (round 6).

Oracle: transformers' `model.generate(do_sample=False)` on each prompt alone. The tiny random Llama attends almost
uniformly (its q/k weights are small), so a wrong position barely moves its argmax: `sharp_model` scales q and k up
so that attention, and with it RoPE's positions, decide the tokens.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.evaluate.generate import SharedPrefixGreedy, eos_ids, greedy_generate_rows
from tests.unit.test_evaluate import make_model, make_tokenizer


@pytest.fixture(scope="module")
def sharp_model():
    model = make_model()
    with torch.no_grad():
        for layer in model.model.layers:  # attention logits x64: sharp attention, position-sensitive outputs
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.generation_config.eos_token_id = None
    return model


def _reference(model, row: list[int], n: int) -> list[int]:
    ids = torch.tensor([row])
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0)[0, len(row):].tolist()


def _rows():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (20, 45, 33)]


def test_left_padded_rows_decode_at_their_own_positions(sharp_model):
    """Each decode step moves every row one position on: a row's continuation is transformers' on that row alone
    (a step that skipped a position passed with the near-uniform tiny model)."""
    rows = _rows()
    assert greedy_generate_rows(sharp_model, rows, 10, prefill_chunk=None) == [
        _reference(sharp_model, r, 10) for r in rows]


def test_decoding_stops_once_every_row_wrote_an_eos_and_cuts_at_the_first(sharp_model):
    """Rows end at different steps, one row writes two EOS tokens: the rows are cut after their first EOS, and
    decoding stops at the step where the last row writes its first EOS (counted as model calls: one prefill pass
    for `prefill_chunk=None`, then one per further token)."""
    rows = _rows()
    alone = [_reference(sharp_model, r, 10) for r in rows]
    eos = {alone[0][1], alone[0][2], alone[1][2], alone[2][3]}
    first = [next(i for i, t in enumerate(a) if t in eos) for a in alone]
    want = [a[:i + 1] for a, i in zip(alone, first)]
    assert len(set(first)) > 1 and alone[0][2] in eos and first[0] < 2 < max(first)  # the cases are there
    calls = []
    hook = sharp_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        out = greedy_generate_rows(sharp_model, rows, 10, eos_token_ids=tuple(eos), prefill_chunk=None)
    finally:
        hook.remove()
    assert out == want
    assert len(calls) == 1 + max(first)


def test_a_prompt_sharing_exactly_min_shared_of_its_tokens_reuses_them(sharp_model):
    """`min_shared` or more of the prompt shared: the cache is kept (boundary included), and the continuation is
    still transformers' on the whole prompt."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(5, 500, (64,), generator=gen).tolist()
    second = base[:8] + torch.randint(5, 500, (56,), generator=gen).tolist()  # shares 8 = 64 / 8 tokens
    assert second[8] != base[8] and SharedPrefixGreedy.min_shared * len(second) == 8
    g = SharedPrefixGreedy(sharp_model, 5, prefill_chunk=None)
    for ids in (base, second):
        assert g(torch.tensor([ids])) == [_reference(sharp_model, ids, 5)]
    assert g.shared_tokens == 8


def test_a_failed_call_drops_the_kept_cache(sharp_model):
    """Out of memory mid-prefill (run_niah then retries): the part-updated cache is dropped, freeing its memory
    for the retry, which gives transformers' continuation."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 500, (1, 40), generator=gen)
    g = SharedPrefixGreedy(sharp_model, 4, prefill_chunk=16)
    g(ids)
    assert g.cache is not None

    def fail(module, args):
        raise torch.OutOfMemoryError("injected")

    hook = sharp_model.model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            g(torch.cat([ids, ids[:, :10]], dim=1))
    finally:
        hook.remove()
    assert g.cache is None and g.ids == []
    longer = torch.cat([ids, ids[:, :10]], dim=1)
    assert g(longer) == [_reference(sharp_model, longer[0].tolist(), 4)]


def test_eos_ids_gathers_the_tokenizers_and_lists_of_ids():
    """Every EOS id: the tokenizer's alone, and each of a list in the generation config (Llama 3 lists several)."""
    model, tok = make_model(), make_tokenizer()
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    assert eos_ids(model, tok) == (tok.eos_token_id,)
    model.generation_config.eos_token_id = [7, 9]
    assert eos_ids(model, tok) == tuple(sorted({7, 9, tok.eos_token_id}))
