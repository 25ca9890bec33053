"""Chunked loss head against Megatron's output layer + vocab-parallel cross entropy and a float64 oracle."""

import pytest
import torch

from megatron_ext.loss_head import vocab_parallel_linear_cross_entropy
from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY
from megatron_ext.recipe import RecipeError


def _draw(dtype, s=37, b=2, h=16, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=gen).to(dtype)
    weight = (torch.randn(vocab, h, generator=gen) * 0.5).to(dtype)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    upstream = torch.rand(b, s, generator=gen)  # d(objective)/d(loss[b, s]), as a loss mask would be
    return hidden, weight, labels, upstream


def _loss_and_grads(fn, hidden, weight, labels, upstream):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss.float() * upstream).sum().backward()
    return loss.detach().double(), h.grad.double(), w.grad.double()


def _megatron(h, w, labels):
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(h @ w.t(), labels.t().contiguous()).t()  # [s, b] -> [b, s]


def _oracle(h, w, labels):
    s, b, _ = h.shape
    logits = (h.double() @ w.double().t()).reshape(s * b, -1)
    return torch.nn.functional.cross_entropy(logits, labels.t().reshape(s * b), reduction="none").view(s, b).t()


def _chunked(chunk):
    return lambda h, w, labels: vocab_parallel_linear_cross_entropy(h, w, labels, chunk_tokens=chunk)


def _max_err(a, b):
    return max((x - y).abs().max().item() / y.abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("chunk", [1, 7, 74, 4096])  # 74 = all tokens, 4096 > all tokens
def test_fp32_equals_megatron_loss_head(cpu_parallel_state, chunk):
    args = _draw(torch.float32)
    ours = _loss_and_grads(_chunked(chunk), *args)
    theirs = _loss_and_grads(_megatron, *args)
    assert _max_err(ours, theirs) < 1e-5
    assert _max_err(ours, _loss_and_grads(_oracle, *args)) < 1e-5


def test_bf16_no_less_exact_than_megatron(cpu_parallel_state):
    """Against float64, the chunked head's bf16 error is of the order of Megatron's own (per-chunk weight
    gradients are rounded to bf16 once each and summed in fp32)."""
    args = _draw(torch.bfloat16, s=96, h=32, vocab=500)
    oracle = _loss_and_grads(_oracle, *(a.double() if a.is_floating_point() else a for a in args))
    ours = _loss_and_grads(_chunked(10), *args)
    theirs = _loss_and_grads(_megatron, *args)
    for name, o, t, ref in zip(("loss", "grad_hidden", "grad_weight"), ours, theirs, oracle):
        err_ours = (o - ref).abs().max().item()
        err_theirs = (t - ref).abs().max().item()
        assert err_ours <= 2 * err_theirs + 1e-6, (name, err_ours, err_theirs)


def test_negative_control_shifted_labels_differ(cpu_parallel_state):
    hidden, weight, labels, upstream = _draw(torch.float32)
    ours = _loss_and_grads(_chunked(7), hidden, weight, (labels + 1) % weight.shape[0], upstream)
    assert _max_err(ours, _loss_and_grads(_megatron, hidden, weight, labels, upstream)) > 0.1


def test_rejects_zero_chunk(cpu_parallel_state):
    hidden, weight, labels, _ = _draw(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)


# ------------------------------------------------------------------------------------------- in the model

WIDE_VOCAB = dict(TINY, vocab_size=4096)  # logits dominate, as with Llama-3's 128K vocabulary


def _pair(cfg, seq, chunk=64, **opts):
    """The same weights in a chunked-head and a Megatron-head model."""
    torch.manual_seed(5)
    full = build_model(cfg, BuildOptions(device="cpu", seq_length=seq, loss_head="full", **opts))
    chunked = build_model(cfg, BuildOptions(device="cpu", seq_length=seq, loss_chunk_tokens=chunk, **opts))
    chunked.load_state_dict(full.state_dict())
    return full, chunked


def _step(model, tokens):
    seq = tokens.shape[1]
    loss = model(tokens, torch.arange(seq).expand_as(tokens), None, labels=torch.roll(tokens, -1, 1))
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_and_grads_equal_megatron_head(cpu_parallel_state, tied):
    full, chunked = _pair(dict(TINY, tie_word_embeddings=tied), 64, chunk=48)
    assert type(chunked).__name__ == "ChunkedLossGPTModel" and type(full).__name__ == "GPTModel"
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    loss_f, grads_f = _step(full, tokens)
    loss_c, grads_c = _step(chunked, tokens)
    torch.testing.assert_close(loss_c, loss_f, rtol=1e-6, atol=1e-6)
    assert grads_c.keys() == grads_f.keys()
    for name in grads_f:
        torch.testing.assert_close(grads_c[name], grads_f[name], rtol=1e-4, atol=1e-6, msg=name)
    # Without labels both return the same logits (Megatron's path).
    with torch.no_grad():
        pos = torch.arange(64).expand(2, 64)
        torch.testing.assert_close(chunked(tokens, pos, None), full(tokens, pos, None))


def test_masked_tokens_form_no_logits_and_change_nothing(cpu_parallel_state, monkeypatch):
    """A loss mask (SFT: loss on the answers only) given to the model: the kept tokens' losses and every gradient
    of the masked loss equal the unmasked chunked head's and Megatron's, with logits formed for kept tokens only."""
    from megatron_ext import loss_head

    full, chunked = _pair(TINY, 64, chunk=16)
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, 64)
    mask[0, 40:55] = 1  # an answer in row 0, two in row 1: not symmetric, so a row/sequence mix-up shows
    mask[1, 5:9] = mask[1, 30:50] = 1
    pos, labels = torch.arange(64).expand(2, 64), torch.roll(tokens, -1, 1)
    head_rows = []
    apply = loss_head._ChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(loss_head._ChunkedLinearCrossEntropy, "apply",
                        lambda hidden, *a: head_rows.append(hidden.shape[0]) or apply(hidden, *a))
    results = []
    for model, kwargs in ((full, {}), (chunked, {}), (chunked, {"loss_mask": mask})):
        model.zero_grad()
        loss = model(tokens, pos, None, labels=labels, **kwargs)
        (loss * mask).sum().backward()
        results.append((loss.detach() * mask, {n: q.grad.clone() for n, q in model.named_parameters()}))
    (loss_f, grads_f), (loss_c, grads_c), (loss_m, grads_m) = results
    assert head_rows == [128, int(mask.sum())]  # the chunked head without, then with the mask: 39 of 128 rows
    torch.testing.assert_close(loss_m, loss_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_m, loss_f, rtol=1e-6, atol=1e-6)
    assert loss_m.sum() > 0 and (loss_m[mask == 0] == 0).all()
    for name in grads_f:
        torch.testing.assert_close(grads_m[name], grads_c[name], rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(grads_m[name], grads_f[name], rtol=1e-4, atol=1e-6, msg=name)


def _saved_bytes(model, tokens) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes autograd keeps from the forward pass (distinct storages) and the shapes of the tensors kept."""
    seen, shapes = {}, []

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        shapes.append(tuple(t.shape))
        return t

    seq = tokens.shape[1]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, torch.arange(seq).expand_as(tokens), None, labels=torch.roll(tokens, -1, 1))
    loss.mean().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params), shapes


def test_chunked_head_keeps_no_logits_for_backward(cpu_parallel_state):
    seq, vocab = 512, WIDE_VOCAB["vocab_size"]
    full, chunked = _pair(WIDE_VOCAB, seq, precision="bf16")
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(2))
    full_bytes, full_shapes = _saved_bytes(full, tokens)
    chunked_bytes, chunked_shapes = _saved_bytes(chunked, tokens)
    # Negative control: Megatron's cross entropy keeps the fp32 softmax [s, b, V] for backward (4 B x V per
    # token; the bf16 logits and their fp32 copy, 6 B, coexist only at the forward peak).
    assert (seq, 1, vocab) in full_shapes
    assert full_bytes - chunked_bytes >= 0.99 * 4 * seq * vocab, (full_bytes, chunked_bytes)
    assert not any(shape and shape[-1] == vocab for shape in chunked_shapes)


def test_bad_loss_options_are_recipe_errors(cpu_parallel_state):
    with pytest.raises(RecipeError, match="train.loss_head"):
        build_model(TINY, BuildOptions(device="cpu", loss_head="fused"))
    with pytest.raises(RecipeError, match="train.loss_chunk_tokens"):
        build_model(TINY, BuildOptions(device="cpu", loss_chunk_tokens=0))


def test_loss_head_bench_runs_at_toy_size(tmp_path):
    """bench/loss_head_bench.py stays runnable: CPU, toy shapes; ratios are to the baseline of the same run."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "bench/loss_head_bench.py"), "--tokens", "96", "--hidden", "16",
                           "--vocab", "256", "--chunks", "16,1000", "--iters", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("loss_head-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"full", "chunked/16", "chunked/1000"} and rows["full"]["time_ratio"] == 1.0
    for row in rows.values():
        assert row["peak_bytes"] > 0 and row["max_rel_loss_diff"] < 1e-5 and row["max_rel_grad_diff"] < 1e-5
    # 16-token chunks hold 1/6 of the logits at a time; the full head holds all 96 tokens' logits
    assert rows["chunked/16"]["memory_ratio"] < 0.7
    # bf16: rows where the weight carries DDP's fp32 main_grad, which the head adds into (the bench asserts it did)
    proc = subprocess.run([sys.executable, str(ROOT / "bench/loss_head_bench.py"), "--tokens", "96", "--hidden", "64",
                           "--vocab", "256", "--chunks", "32", "--iters", "1", "--dtype", "bf16", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = (p for p in tmp_path.glob("loss_head-*.json") if json.loads(p.read_text())["dtype"] == "bf16")
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"full", "chunked/32", "chunked/32+main_grad"}
    assert rows["chunked/32+main_grad"]["max_rel_grad_diff"] < 2e-2  # bf16 GEMMs of another shape than Megatron's
    bad = subprocess.run([sys.executable, str(ROOT / "bench/loss_head_bench.py"), "--chunks", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 1 and "--chunks '0'" in bad.stderr and "Traceback" not in bad.stderr


def test_megatron_postprocess_signature_we_override():
    """`ChunkedLossGPTModel._postprocess` relies on these parameters of Megatron-Core 0.16's GPTModel; an
    upgrade that renames them must fail here, not silently fall back to another loss path."""
    import inspect

    from megatron.core.models.gpt import GPTModel

    params = list(inspect.signature(GPTModel._postprocess).parameters)
    assert params[:5] == ["self", "hidden_states", "input_ids", "position_ids", "labels"]
    assert {"mtp_in_postprocess", "inference_context", "loss_mask"} <= set(params)


# ------------------------------------------------------------------------------------- under Megatron's DDP

def _ddp_step(model, tokens, overrides, microbatches=2):
    """Two microbatches of one step under the trainer's DDP: every parameter's main_grad, and what stayed in .grad."""
    from pathlib import Path

    from megatron_ext.recipe import load_recipe
    from megatron_ext.train import wrap_ddp

    seq = tokens.shape[1]
    recipe = load_recipe(Path(__file__).parents[2] / "recipes/tiny/cpt.yaml",
                         ["parallel.context=1", f"train.seq_length={seq}", *overrides], world_size=1)
    ddp = wrap_ddp(recipe, model)
    ddp.zero_grad_buffer()
    for micro in range(microbatches):
        batch = torch.roll(tokens, micro, 1)
        loss = ddp(batch, torch.arange(seq).expand_as(batch), None, labels=torch.roll(batch, -1, 1))
        loss.float().mean().backward()
    ddp.finish_grad_sync()
    return ({n: p.main_grad.clone() for n, p in ddp.named_parameters()},
            [n for n, p in ddp.named_parameters() if p.grad is not None])


@pytest.mark.parametrize("tied, overrides", [(False, []), (True, []), (False, ["train.overlap_grad_reduce=true"]),
                                             (True, ["train.overlap_grad_reduce=true"])])
def test_ddp_main_grad_equals_megatron_head(cpu_parallel_state, tied, overrides):
    """Under DDP the chunked head adds the output weight's gradient straight into main_grad (no fp32 and bf16
    copies of the weight's size); every parameter's accumulated gradient equals Megatron's head's, the tied
    embedding's included (where the head's placeholder gradient must be zeros: `zero_out_wgrad`)."""
    full, chunked = _pair(dict(TINY, tie_word_embeddings=tied), 64, chunk=48)
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    grads_f, left_f = _ddp_step(full, tokens, overrides)
    grads_c, left_c = _ddp_step(chunked, tokens, overrides)
    assert left_f == left_c == []  # DDP's hook consumed every .grad
    head = "module.embedding.word_embeddings.weight" if tied else "module.output_layer.weight"
    assert chunked.shared_embedding_or_output_weight().grad_added_to_main_grad if tied else \
        chunked.output_layer.weight.grad_added_to_main_grad  # the head's own accumulation path ran
    assert grads_c.keys() == grads_f.keys() and head in grads_c
    for name in grads_f:
        torch.testing.assert_close(grads_c[name], grads_f[name], rtol=1e-4, atol=1e-6, msg=name)


def _new_weight_sized_tensors(ddp, tokens, shape, monkeypatch):
    """Each tensor of `shape` with new storage that one microbatch's backward creates, as (dtype, bytes, made inside
    the chunked head's backward). Tensors are told apart by when they are made, not by address: the embedding's own
    [V, h] gradient, made later by Megatron's embedding, may reuse the freed product's memory or not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_ext import loss_head

    made, in_head = [], [False]
    head_backward = loss_head._ChunkedLinearCrossEntropy.backward

    def timed_backward(ctx, grad_loss):
        in_head[0] = True
        try:
            return head_backward(ctx, grad_loss)
        finally:
            in_head[0] = False

    monkeypatch.setattr(loss_head._ChunkedLinearCrossEntropy, "backward", staticmethod(timed_backward))

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and tuple(t.shape) == shape and \
                        t.untyped_storage().data_ptr() not in inputs | existing:
                    made.append((t.dtype, t.untyped_storage().nbytes(), in_head[0]))
            return out

    seq = tokens.shape[1]
    ddp.zero_grad_buffer()
    loss = ddp(tokens, torch.arange(seq).expand_as(tokens), None, labels=torch.roll(tokens, -1, 1))
    existing = {p.untyped_storage().data_ptr() for p in ddp.parameters()}
    existing |= {p.main_grad.untyped_storage().data_ptr() for p in ddp.parameters()}
    with Record():
        loss.float().mean().backward()
    return made


def test_bf16_ddp_head_makes_one_weight_sized_temporary(cpu_parallel_state, monkeypatch):
    """bf16 under DDP: the chunked head's backward forms one bf16 tensor of the output weight's size (each chunk's
    product, then the placeholder gradient) and no fp32 one: at TP=1 with Llama-3's vocabulary that is 1 GB where
    an fp32 accumulator, an fp32 copy of each product and a final bf16 cast held 5 GB at once. Its main_grad is as
    close to the fp32 model's as Megatron's head's is."""
    from pathlib import Path

    from megatron_ext.recipe import load_recipe
    from megatron_ext.train import wrap_ddp

    cfg = dict(WIDE_VOCAB, vocab_size=1024)
    full, chunked = _pair(cfg, 128, chunk=32, precision="bf16")
    oracle, _ = _pair(cfg, 128, chunk=32)  # fp32 weights: the same draw
    tokens = torch.randint(0, 1024, (1, 128), generator=torch.Generator().manual_seed(3))
    name = "module.module.output_layer.weight"
    got_f, _ = _ddp_step(full, tokens, [])
    got_c, _ = _ddp_step(chunked, tokens, [])
    ref = _ddp_step(oracle, tokens, [])[0][name.replace("module.module.", "module.")]
    err_c, err_f = ((got[name] - ref).abs().max().item() for got in (got_c, got_f))
    assert err_c <= 1.5 * err_f, (err_c, err_f)

    recipe = load_recipe(Path(__file__).parents[2] / "recipes/tiny/cpt.yaml",
                         ["parallel.context=1", "train.seq_length=128"], world_size=1)
    shape = tuple(chunked.output_layer.weight.shape)
    made = _new_weight_sized_tensors(wrap_ddp(recipe, chunked), tokens, shape, monkeypatch)
    assert [dtype for dtype, _, in_head in made if in_head] == [torch.bfloat16], made
    assert torch.float32 not in {dtype for dtype, _, _ in made}, made  # nor an fp32 copy after it (DDP's hook)
