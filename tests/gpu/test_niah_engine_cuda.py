"""The Megatron evaluation engine (megatron_ext.evaluate.parallel) on one CUDA GPU against transformers there.

The CPU tests cover TP/PP/CP/DP on gloo; this one covers the CUDA path of one rank: the model built for cuda
(TE's spec where TE imports, else torch SDPA), NCCL collectives of size 1, tensors on the device. Oracle:
transformers' LlamaForCausalLM on the same GPU, fp32 (greedy token after every position, token losses, and the
same through the KV cache: a prefill of 150 tokens, then decode steps of one token and one of ten); bf16 losses
within 0.05 of fp32; rows of different lengths in one call (RULER-style runs) decoded as transformers does; a
prompt sharing its first 120 tokens with the cached one through an extension pass (SDPA with a lower-right causal
mask over the cached prefix's keys and its own, as CP ranks run it).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_engine_on_cuda_matches_transformers(tiny_checkpoint, gpu_state):
    from megatron_ext.evaluate import load_hf
    from megatron_ext.evaluate.engine import load_megatron_for_eval
    from megatron_ext.evaluate.parallel import MegatronGreedy, MegatronTokenLosses
    from megatron_ext.evaluate.perplexity import token_losses

    hf, _ = load_hf(tiny_checkpoint / "hf", "cuda", "fp32")
    ids = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids[None].cuda()).logits[0].argmax(-1).tolist()
    want_losses = token_losses(hf, ids, chunk=None).cpu()
    device = torch.device("cuda", torch.cuda.current_device())
    losses = {}
    for precision in ("fp32", "bf16"):
        model, cfg, _ = load_megatron_for_eval(tiny_checkpoint / "mc", device="cuda", precision=precision)
        # every weight on the GPU, the local spec's torch norms too (they were built on the host)
        assert {t.device for t in [*model.parameters(), *model.buffers()]} == {device}
        losses[precision] = MegatronTokenLosses(model, device)(ids)
        if precision == "fp32":
            gen = MegatronGreedy(model, cfg["vocab_size"], 4, device=device, kv_cache=False)
            got = gen.predict(ids.tolist(), 0)
            assert sum(a == b for a, b in zip(got, want)) == len(want)
            cached = MegatronGreedy(model, cfg["vocab_size"], 4, device=device)
            got = cached.predict(ids[:150].tolist(), 0)
            for end in range(151, 191):
                got += cached.predict(ids[:end].tolist(), end - 1)
            got += cached.predict(ids.tolist(), 190)
            assert (cached.passes, cached.decode_steps) == (1, 41)
            assert sum(a == b for a, b in zip(got, want)) == len(want)
        del model
    assert (losses["fp32"] - want_losses).abs().max() < 1e-3
    assert (losses["bf16"] - want_losses).abs().mean() < 0.05


def test_rows_of_different_lengths_on_cuda(tiny_checkpoint, gpu_state):
    """What the RULER-style runs send the engine: one call with prompts of different lengths; each row's greedy
    continuation (KV cache on) equals transformers' on the GPU."""
    from megatron_ext.evaluate import greedy_generate, load_hf
    from megatron_ext.evaluate.engine import load_megatron_for_eval
    from megatron_ext.evaluate.parallel import MegatronGreedy

    hf, _ = load_hf(tiny_checkpoint / "hf", "cuda", "fp32")
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 500, (n,), generator=gen) for n in (77, 120, 201)]
    want = [greedy_generate(hf, row[None].cuda(), 6, eos_token_ids=(2,), prefill_chunk=None)[0] for row in rows]
    model, cfg, _ = load_megatron_for_eval(tiny_checkpoint / "mc", device="cuda", precision="fp32")
    engine = MegatronGreedy(model, cfg["vocab_size"], 6, eos_token_ids=(2,),
                            device=torch.device("cuda", torch.cuda.current_device()))
    assert engine([row.tolist() for row in rows]) == want
    assert engine.passes == 3


def test_pass_after_a_shared_prefix_on_cuda(tiny_checkpoint, gpu_state):
    """An extension pass (`kv_cache.extending`) on the GPU: the greedy token after each position of a prompt whose
    first 120 tokens are the cached prompt's equals transformers' on the whole prompt, and so do the decode steps
    after it."""
    from megatron_ext.evaluate import load_hf
    from megatron_ext.evaluate.engine import load_megatron_for_eval
    from megatron_ext.evaluate.parallel import MegatronGreedy

    hf, _ = load_hf(tiny_checkpoint / "hf", "cuda", "fp32")
    gen = torch.Generator().manual_seed(9)
    first = torch.randint(3, 500, (200,), generator=gen).tolist()
    other = first[:120] + torch.randint(3, 500, (84,), generator=gen).tolist()  # 204 tokens
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([other]).cuda()).logits[0].argmax(-1).tolist()
    model, cfg, _ = load_megatron_for_eval(tiny_checkpoint / "mc", device="cuda", precision="fp32")
    engine = MegatronGreedy(model, cfg["vocab_size"], 4, device=torch.device("cuda", torch.cuda.current_device()))
    engine.max_decode_tokens = 4  # a pass over the 80 tokens after the prefix, not a decode step
    engine.predict(first, 199)
    got = engine.predict(other[:200], 120) + engine.predict(other[:201], 200) + engine.predict(other, 201)
    assert (engine.passes, engine.extensions, engine.shared_tokens, engine.decode_steps) == (1, 1, 120, 2)
    assert sum(a == b for a, b in zip(got, want[120:])) == len(want) - 120
