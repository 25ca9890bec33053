"""Greedy decoding with a draft (megatron_ext.evaluate.parallel.speculative_greedy) against plain greedy decoding.

The "model" is a deterministic next-token rule over the whole prefix; plain greedy asks it once per token.
Whatever the draft, the continuation must be the plain one; a draft that agrees costs one pass.
"""

from __future__ import annotations

import random

import pytest

from megatron_ext.evaluate.speculative import number_settled, speculative_greedy

VOCAB = 13


def next_token(prefix: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(prefix[-4:])) * 7 + len(prefix)) % VOCAB


def predict(ids: list[int], first: int) -> list[int]:
    return [next_token(ids[:p + 1]) for p in range(first, len(ids))]


def plain_greedy(prompt, max_new, eos=(), settled=None) -> list[int]:
    out: list[int] = []
    while len(out) < max_new:
        out.append(next_token(list(prompt) + out))
        if out[-1] in eos or (settled and settled(out)):
            break
    return out


@pytest.mark.parametrize("seed", range(40))
def test_any_draft_gives_the_greedy_continuation(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
    max_new = rng.randint(1, 8)
    eos = (rng.randrange(VOCAB),) if seed % 3 == 0 else ()
    settled = (lambda out: len(out) >= 2 and out[-1] % 2 == 0) if seed % 4 == 1 else None
    want = plain_greedy(prompt, max_new, eos, settled)
    right = plain_greedy(prompt, 12)  # the continuation without stops: a draft that agrees throughout
    cut = rng.randrange(len(right))
    wrong_at_cut = right[:cut] + [(right[cut] + 1) % VOCAB] + right[cut + 1:]
    noise = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
    for draft in ([], right, right[:cut], wrong_at_cut, noise):
        got, passes = speculative_greedy(predict, prompt, draft, max_new, eos, settled)
        assert got == want, (draft, got, want)
        assert 1 <= passes <= len(want)
    _, passes = speculative_greedy(predict, prompt, right, max_new, eos, settled)
    assert passes == 1  # the draft held the whole answer: one pass


def test_passes_count_the_agreeing_prefix():
    prompt = [3, 1, 4]
    right = plain_greedy(prompt, 6)
    wrong_third = right[:2] + [(right[2] + 1) % VOCAB] + right[3:]
    assert speculative_greedy(predict, prompt, wrong_third, 6) == (right, 1 + 3)  # 3 tokens, then 1 per pass
    assert speculative_greedy(predict, prompt, [], 6) == (right, 6)


def test_number_settled():
    assert not number_settled(" The")
    assert not number_settled(" 48172")          # more digits may follow
    assert number_settled(" 4817263.")
    assert number_settled("x 12 y")
    assert not number_settled("")


def test_no_new_tokens_asked_gives_none_and_runs_no_pass():
    """max_new_tokens=0: nothing to decode (the cut at max_new_tokens was only checked after a token was taken)."""
    prompt = [3, 1, 4]
    assert speculative_greedy(predict, prompt, plain_greedy(prompt, 3), 0) == ([], 0)
    assert speculative_greedy(predict, prompt, [], 0) == ([], 0)
