"""Greedy decoding and chunked forward passes for long prompts on HF causal LMs.

Long prompts are prefilled in chunks through the model's KV cache, so the activations (MLP
intermediate, logits) of a 1M-token prompt are those of one chunk, and only the KV cache grows
with the length. Greedy decoding is then one token per step; it matches `model.generate(
do_sample=False)` token for token (tested). `SharedPrefixGreedy` keeps the cache from prompt to
prompt, so that a prompt starting like the one before runs only the rest.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from megatron_ext.eval_plan import MIN_SHARED_PREFIX


def _cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def auto_prefill_chunk(length: int, batch: int = 1, mask_budget_bytes: int = 1 << 30, one_pass_up_to: int = 32768,
                       lo: int = 256, hi: int = 8192) -> int:
    """Prefill chunk (tokens) for a prompt of `length` tokens x `batch` rows.

    Up to `one_pass_up_to` tokens: one pass (with an empty cache transformers lets SDPA use its
    causal flash kernel, no mask). Beyond, chunks: a chunk after the first attends to the cache
    through a [batch, chunk, length] boolean mask that transformers materialises, so the chunk is
    the largest power of two in [lo, hi] whose mask fits `mask_budget_bytes` (1M tokens: 1024).
    """
    if length <= one_pass_up_to:
        return length
    fit = max(1, mask_budget_bytes // (length * batch))
    return max(lo, min(hi, 1 << (fit.bit_length() - 1)))


def _forward_kwargs(model, cache, last_only: bool) -> dict:
    """Keyword arguments for a cached forward, named as this transformers version names them.

    The cache is `cache` in newer transformers 5 and `past_key_values` before; "logits of the last
    position only" is `logits_to_keep=1` (4.50+) or `num_logits_to_keep=1` (4.45-4.49).
    """
    params = inspect.signature(model.forward).parameters
    kwargs = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            kwargs[name] = 1 if last_only else 0
            break
    return kwargs


def chunked_forward(model, input_ids: torch.Tensor, chunk: int | None, logits_for_all: bool,
                    cache=None) -> Iterator[tuple[int, torch.Tensor, object]]:
    """Run `input_ids` [B, L] through `model` in chunks of `chunk` tokens with a KV cache.

    Yields (start, logits, cache) per chunk: logits are [B, c, V] for the chunk's c positions when
    `logits_for_all`, else [B, 1, V] for its last position only. `chunk` None or 0: one pass.
    """
    batch, length = input_ids.shape
    chunk = length if not chunk or chunk <= 0 else chunk
    cache = _cache(model) if cache is None else cache  # filled in place by each call
    kwargs = _forward_kwargs(model, cache, last_only=not logits_for_all)
    for start in range(0, length, chunk):
        out = model(input_ids=input_ids[:, start:start + chunk], **kwargs)
        yield start, out.logits if logits_for_all else out.logits[:, -1:], cache


@torch.inference_mode()
def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_ids: tuple[int, ...] = (),
                    prefill_chunk: int | str | None = "auto") -> list[list[int]]:
    """Greedy continuation of each row of `input_ids` [B, L] (no padding: rows share length L).

    `prefill_chunk`: tokens per prefill pass ("auto": `auto_prefill_chunk`; None or 0: one pass).
    Returns per row the new token ids, cut after the first EOS (included) or at `max_new_tokens`.
    """
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    batch, length = input_ids.shape
    if prefill_chunk == "auto":
        prefill_chunk = auto_prefill_chunk(length, batch)
    logits = cache = None
    for _, logits, cache in chunked_forward(model, input_ids, prefill_chunk, logits_for_all=False):
        pass
    return _decode(logits, max_new_tokens, eos_token_ids,
                   lambda nxt: model(input_ids=nxt[:, None], **_forward_kwargs(model, cache, last_only=True)).logits)


def _decode(logits: torch.Tensor, max_new_tokens: int, eos_token_ids, step: Callable) -> list[list[int]]:
    """Greedy tokens after the prefill's logits `[B, *, V]`: `step(next_ids [B])` runs them through the model and
    returns its logits. Stops once every row has written an EOS, or at `max_new_tokens`; rows are cut after their
    first EOS (kept)."""
    batch, device = logits.shape[0], logits.device
    out = torch.empty(batch, 0, dtype=torch.long, device=device)
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for n in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)  # [B]
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= torch.isin(nxt, eos)
        if bool(done.all()) or n == max_new_tokens - 1:
            break
        logits = step(nxt)
    rows = []
    for row in out.tolist():
        hit = [i for i, t in enumerate(row) if t in set(eos_token_ids)]
        rows.append(row[: hit[0] + 1] if hit else row)
    return rows


@torch.inference_mode()
def greedy_generate_rows(model, rows: list[list[int]], max_new_tokens: int, *, eos_token_ids: tuple[int, ...] = (),
                         prefill_chunk: int | str | None = "auto", pad_token_id: int = 0) -> list[list[int]]:
    """`greedy_generate` for rows of any lengths in one batch. Rows of one length go to `greedy_generate`; others are
    left-padded, with an attention mask and positions counted from each row's first token, so each row decodes as it
    would alone (the mask means a [batch, chunk, length] tensor in every pass: "auto" chunks to keep it under 1 GiB)."""
    if len({len(r) for r in rows}) == 1:
        return greedy_generate(model, torch.tensor(rows, dtype=torch.long), max_new_tokens,
                               eos_token_ids=eos_token_ids, prefill_chunk=prefill_chunk)
    device = next(model.parameters()).device
    batch, longest = len(rows), max(map(len, rows))
    ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, longest - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, longest - len(row):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]; pads sit at 0 and are masked
    if prefill_chunk == "auto":
        prefill_chunk = auto_prefill_chunk(longest, batch, one_pass_up_to=0)
    chunk = prefill_chunk or longest
    cache = _cache(model)
    kwargs = _forward_kwargs(model, cache, last_only=True)
    for start in range(0, longest, chunk):
        end = min(start + chunk, longest)
        logits = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                       **kwargs).logits
    state = {"mask": mask, "position": positions[:, -1:]}

    def step(nxt: torch.Tensor) -> torch.Tensor:  # one more unmasked column, one position further
        state["mask"] = torch.cat([state["mask"], torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
        state["position"] = state["position"] + 1
        return model(input_ids=nxt[:, None], attention_mask=state["mask"], position_ids=state["position"],
                     **kwargs).logits

    return _decode(logits, max_new_tokens, eos_token_ids, step)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` share (numpy: prompts of millions of ids)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class SharedPrefixGreedy:
    """`greedy_generate` that keeps the KV cache of the last prompt it ran alone: a prompt alone in its batch whose
    first `min_shared` or more of tokens are that prompt's runs only the rest, the cache cropped to the shared
    prefix (NIAH prompts of one length share the haystack up to the shallower needle). Batches of several rows
    run as `greedy_generate`, and so does every prompt with `min_shared` > 1. `shared_tokens` counts the prompt
    tokens not run again."""

    min_shared = MIN_SHARED_PREFIX

    def __init__(self, model, max_new_tokens: int, *, eos_token_ids: tuple[int, ...] = (),
                 prefill_chunk: int | str | None = "auto"):
        self.model, self.max_new_tokens, self.eos = model, max_new_tokens, eos_token_ids
        self.prefill_chunk = prefill_chunk
        self.cache, self.ids, self.shared_tokens = None, [], 0

    def clear(self) -> None:
        """Drop the kept cache (frees its memory)."""
        self.cache, self.ids = None, []

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> list[list[int]]:
        if input_ids.shape[0] != 1 or self.min_shared > 1:
            self.clear()
            return greedy_generate(self.model, input_ids, self.max_new_tokens, eos_token_ids=self.eos,
                                   prefill_chunk=self.prefill_chunk)
        try:
            return self._alone(input_ids[0].tolist())
        except BaseException:  # out of memory: run_niah retries; the cache may be part-updated
            self.clear()
            raise

    def _alone(self, ids: list[int]) -> list[list[int]]:
        shared = common_prefix(ids[:-1], self.ids)  # the last prompt token runs: its logits give the first answer
        if shared < self.min_shared * len(ids):
            self.clear()  # before the pass, so that the old cache does not sit beside the new one
            shared = 0
        elif shared < self.cache.get_seq_length():
            self.cache.crop(shared - self.cache.get_seq_length())  # negative: tokens to drop (transformers 4 and 5)
        # after a cached prefix each chunk attends through a [chunk, length] mask that transformers materialises:
        # "one pass" (None, 0) would be a [rest, length] mask, so such a pass takes auto's chunks
        auto = self.prefill_chunk == "auto" or (shared and not self.prefill_chunk)
        chunk = auto_prefill_chunk(len(ids)) if auto else self.prefill_chunk
        device = next(self.model.parameters()).device
        logits = cache = None
        for _, logits, cache in chunked_forward(self.model, torch.tensor([ids[shared:]], device=device), chunk,
                                                logits_for_all=False, cache=self.cache):
            pass
        self.cache, self.ids = cache, []  # until decoding is through
        kwargs = _forward_kwargs(self.model, cache, last_only=True)
        out = _decode(logits, self.max_new_tokens, self.eos,
                      lambda nxt: self.model(input_ids=nxt[:, None], **kwargs).logits)
        self.ids = (ids + out[0])[:cache.get_seq_length()]  # the last new token never ran
        self.shared_tokens += shared
        return out


GenerateFn = Callable[[torch.Tensor], list[list[int]]]
"""A generator for NIAH: prompts [B, L] -> new token ids per row (the default is `SharedPrefixGreedy`)."""


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """All end-of-sequence token ids known to the tokenizer and the model's generation config."""
    ids: set[int] = set()
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(getattr(model, "config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))
