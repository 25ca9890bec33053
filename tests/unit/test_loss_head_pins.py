"""Pins from mutation audit round 7 of megatron_ext/loss_head.py: sequence-parallel chunking when a chunk is smaller
than the TP size, DDP main_grad buffers the head must not add into, and the model's chunk size reaching the head."""

import pytest
import torch

from megatron_ext import loss_head
from megatron_ext.loss_head import vocab_parallel_linear_cross_entropy


@pytest.mark.parametrize("chunk_tokens", [1, 3, 8, 100])
def test_sequence_parallel_chunks_cover_every_token_once(chunk_tokens):
    """Under sequence parallelism with 4 TP ranks holding 5 tokens each, the chunks' positions in the full sequence
    (oracle: rank r's local row i is token 5r + i) are every token exactly once, each chunk takes the same local rows
    on every rank, and gathers at most max(chunk_tokens, TP) rows. chunk_tokens < TP (1, 3) still makes progress
    (mutant: a chunk of chunk_tokens // TP = 0 rows, a range() step of 0)."""
    tp, local = 4, 5
    seen = []
    for rows, where in loss_head._chunks(local, tp, True, chunk_tokens, "cpu"):
        local_rows = list(range(local))[rows]
        assert where.tolist() == [r * local + i for r in range(tp) for i in local_rows]
        assert len(where) <= max(chunk_tokens, tp)
        seen += where.tolist()
    assert sorted(seen) == list(range(tp * local))


def _head_grads(weight, main_grad):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 2, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, weight.shape[0], (2, 9), generator=gen)
    w = weight.clone().requires_grad_()
    w.main_grad, w.grad_added_to_main_grad = main_grad, False
    vocab_parallel_linear_cross_entropy(hidden, w, labels, chunk_tokens=4).sum().backward()
    ref_w = weight.double().requires_grad_()
    torch.nn.functional.cross_entropy((hidden.detach().double() @ ref_w.t()).reshape(18, -1),
                                      labels.t().reshape(18), reduction="sum").backward()
    return w, ref_w.grad


@pytest.mark.parametrize("buffer", ["bf16", "flat fp32"])
def test_a_main_grad_the_head_cannot_add_into_is_left_to_ddp(buffer):
    """A `main_grad` of another dtype (DDP's bf16 gradient reduce) or shape is not the head's to add into: the weight
    gradient comes back in `.grad` (equal to a float64 cross entropy's), main_grad stays untouched and
    `grad_added_to_main_grad` unset, so DDP's own hook adds it (mutants: bf16 or misshapen buffers taken, .grad an
    uninitialised placeholder)."""
    weight = torch.randn(30, 8, generator=torch.Generator().manual_seed(1)) * 0.5
    main_grad = (torch.zeros(30, 8, dtype=torch.bfloat16) if buffer == "bf16"
                 else torch.zeros(30 * 8, dtype=torch.float32))
    w, want = _head_grads(weight, main_grad)
    assert not w.grad_added_to_main_grad and not main_grad.any()
    torch.testing.assert_close(w.grad.double(), want, rtol=1e-5, atol=1e-6)


def test_the_models_chunk_size_reaches_the_head(cpu_parallel_state, monkeypatch):
    """train.loss_chunk_tokens (the model's `loss_chunk_tokens`) is the chunk the head runs with, not the default of
    2048 (mutant): it bounds the logits memory, and the plan (tools/plan.py) sizes the head by it. Observed at the
    head's entry (the loss itself does not depend on the chunk)."""
    from megatron_ext.model import BuildOptions, build_model
    from megatron_ext.presets import TINY

    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32, loss_chunk_tokens=24))
    chunks = []
    apply = loss_head._ChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(loss_head._ChunkedLinearCrossEntropy, "apply",
                        lambda *a: chunks.append(a[-1]) or apply(*a))
    tokens = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(32)[None], None, labels=torch.roll(tokens, -1, 1))
    assert chunks == [24]


def test_a_mask_of_all_ones_hands_the_head_the_hidden_states_uncopied(monkeypatch):
    """A loss mask that keeps every token (CPT with a mask, an SFT pack without prompts) takes the plain path: the
    head gets the hidden states themselves, not an index_select copy of them (at 128K tokens and h = 4096 in bf16,
    1 GB more at the loss head's peak; mutant). The loss is the unmasked one either way."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(6, 2, 8, generator=gen), torch.randn(20, 8, generator=gen)
    labels = torch.randint(0, 20, (2, 6), generator=gen)
    handed = []
    apply = loss_head._ChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(loss_head._ChunkedLinearCrossEntropy, "apply", lambda h, *a: handed.append(h) or apply(h, *a))
    loss = vocab_parallel_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, loss_mask=torch.ones(2, 6))
    assert len(handed) == 1 and handed[0].untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()
    torch.testing.assert_close(loss, vocab_parallel_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4))
