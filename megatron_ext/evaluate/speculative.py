"""Greedy decoding checked against a draft (speculative decoding whose draft model is the expected answer).

The Megatron evaluation engine (`parallel.py`) runs a pass over the prompt and the draft at once and keeps the
model's predictions as far as they agree with the draft: a model that retrieves the needle answers in one pass.
Pure Python: the model is a `PredictFn`.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

PredictFn = Callable[[list[int], int], list[int]]
"""(token ids, first) -> the greedy next token after each position first .. len(ids) - 1. `speculative_greedy`
gives it one list for all its passes, changed in place between them (at 4M tokens a new list per pass costs more
than the GPU's decode step): it must not keep the list."""


def number_settled(text: str) -> bool:
    """True once the first number in `text` cannot change: a digit run followed by something else."""
    m = re.search(r"\d+", text)
    return m is not None and m.end() < len(text)


def speculative_greedy(predict: PredictFn, prompt: Sequence[int], draft: Sequence[int], max_new_tokens: int,
                       eos_token_ids: Sequence[int] = (), settled: Callable[[list[int]], bool] | None = None,
                       ) -> tuple[list[int], int]:
    """Greedy continuation of `prompt`, checked against `draft` in each pass. Returns (new ids, passes).

    Each pass predicts the token after every position from the last accepted one to the end of the draft; the
    prediction at the last accepted position is the next token, and so is each following prediction while the
    draft token before it was the one predicted. The result equals plain greedy decoding (one pass per token)
    for any draft: cut after the first EOS (included), at `max_new_tokens`, or once `settled(new ids)`.
    """
    eos = set(eos_token_ids)
    ids, n_prompt = list(prompt), len(prompt)  # each pass: prompt + out + rest, the tail rewritten in place
    out: list[int] = []
    rest = list(draft)
    passes = 0
    while len(out) < max_new_tokens:
        del ids[n_prompt:]
        ids += out
        ids += rest
        preds = predict(ids, n_prompt + len(out) - 1)
        passes += 1
        accepted = [preds[0]]
        for proposed, predicted_next in zip(rest, preds[1:]):
            if proposed != accepted[-1]:
                break
            accepted.append(predicted_next)
        for token in accepted:
            out.append(token)
            if token in eos or len(out) == max_new_tokens or (settled is not None and settled(out)):
                return out, passes
        rest = []  # the draft is used up, or the model left it: one token per pass from here
    return out, passes
