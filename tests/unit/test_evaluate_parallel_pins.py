"""The Megatron evaluation engine (megatron_ext.evaluate.parallel) in one process: what the multi-rank tests
(tests/distributed/test_niah_megatron.py) cannot reach with their checkpoint. Pinned by mutation testing.

A tiny Megatron `GPTModel` built here (TINY preset, CPU, SDPA attention) on the single-rank gloo group. Reference:
the model's own forward over the whole sequence, its logits' argmax over the real vocabulary computed in the test.
"""

from __future__ import annotations

import copy

import torch

from megatron_ext.presets import TINY


def build(cfg: dict):
    from megatron_ext.model import BuildOptions, build_model

    return build_model(cfg, BuildOptions(device="cpu", attention="sdpa", seq_length=64)).eval()


def full_pass_argmax(model, ids: list[int], vocab: int) -> list[int]:
    """Greedy next token after every position of `ids`: one forward, the argmax over the first `vocab` logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)  # [1, s, padded vocab]
    return logits[0, :, :vocab].argmax(-1).tolist()


def test_greedy_never_picks_a_padded_vocabulary_row(cpu_parallel_state):
    """A 500-token vocabulary has 512 output rows (padded to a multiple of 128). Rows 500..511 are made to win the
    argmax nearly everywhere: the engine's tokens must still be the best of the real 500 (the multi-rank tests'
    vocabulary of 512 has no padded row)."""
    from megatron_ext.evaluate.parallel import MegatronGreedy

    torch.manual_seed(0)
    model = build({**copy.deepcopy(TINY), "vocab_size": 500})
    weight = model.output_layer.weight
    assert weight.shape[0] == 512
    with torch.no_grad():
        weight[500:] = 1000 * weight[:12]
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        every = model(torch.tensor([ids]), torch.arange(40)[None], None)[0].argmax(-1)
    assert (every >= 500).float().mean() > 0.9  # the padded rows would win
    want = full_pass_argmax(model, ids, 500)
    assert MegatronGreedy(model, 500, 4, kv_cache=False).predict(ids, 0) == want
    assert MegatronGreedy(model, 500, 4).predict(ids, 0) == want


def test_length_dependent_rope_runs_without_the_kv_cache(cpu_parallel_state):
    """Dynamic RoPE's table depends on the whole length, so a cache cannot be extended position by position: the
    engine runs every step as a full pass and its continuation is the plain greedy one (each token the argmax of a
    full forward over the prompt and the tokens so far)."""
    from megatron_ext.evaluate.parallel import MegatronGreedy

    torch.manual_seed(0)
    model = build({**copy.deepcopy(TINY), "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    prompt = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    want: list[int] = []
    for _ in range(4):
        want.append(full_pass_argmax(model, prompt + want, 512)[-1])
    gen = MegatronGreedy(model, 512, 4)
    assert gen.cache is None
    assert gen([prompt]) == [want] and (gen.passes, gen.decode_steps) == (4, 0)
