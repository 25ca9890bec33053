"""KV cache for decoding on the Megatron evaluation engine, split over context-parallel ranks.

Without a cache each new token costs a forward pass over the whole prompt: minutes at 4M tokens. Here the prompt's
pass (the prefill: zigzag CP chunks, the training attention backend, TE's or ours) leaves every layer's keys and
values of this rank's chunks in place (`recording`). A decode step then runs the model on the new tokens only, the
same tokens on every CP rank (`decoding`): each rank attends the new queries to its own part of the cache, and the
ranks' partial results are merged by their log-sum-exp, one all-gather of `[b, heads, n, d + 1]` per layer (how
flash-decoding merges the splits of a long cache). The new tokens' keys and values are kept on every rank but
attended by CP rank 0 only, so each key counts once. RoPE of the new tokens comes from
`ScaledRotaryEmbedding.positions`. Entries at or after the first new position are ignored, so a step may also roll
back the tokens of a draft the model did not take.

A prompt that starts like the cached one (NIAH prompts of one length share the haystack before their needle) runs
only its tokens after the shared prefix (`extending`): a pass over them, zigzag-split over CP like a prefill,
whose queries attend to the cached prefix (gathered from the CP ranks, one layer at a time, the keys a prefill of
the whole prompt would have all-gathered too) and to the pass's own keys; each rank then keeps its rows after the
prefix. For a grid whose depths spread evenly this skips about 40% of the prefill's tokens (11 depths: at most 4.5/11).

Cache size per rank: 2 x layers/PP x KV heads/TP x head dim x bytes per value per token of the prompt / CP (for
Llama-3.1-8B in bf16: 128 KiB per token / (TP x CP); 1M tokens at TP 8 x CP 4: 4 GiB on each rank).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.attention import zigzag_causal_attention
from megatron_ext.context_parallel import cp_positions
from megatron_ext.evaluate.generate import common_prefix

# Keys attended per block in fp32 (bounds the temporary scores and the fp32 copy of a bf16 cache).
KEY_BLOCK = 65536


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one part of the keys, in fp32: (output `[b, nh, n, d]`, log-sum-exp `[b, nh, n]`).

    q `[b, nh, n, d]`, k/v `[b, ng, S, d]` (GQA: head h reads KV head h // (nh / ng)), visible `[n, S]` bool.
    A query that sees no key gets output 0 and log-sum-exp -inf, the neutral element of `merge`.
    """
    b, nh, n, d = q.shape
    ng = k.shape[1]
    g = nh // ng
    # the g query heads of a KV head as rows of one matmul: a `[b, ng, 1, S', d]` operand broadcast against
    # `[b, ng, g, n, d]` would be copied g times by matmul (4x the block's bytes for Llama's GQA)
    qg = q.float().reshape(b, ng, g * n, d)
    outs, lses = [], []
    for start in range(0, k.shape[2], KEY_BLOCK):
        kb, vb = (t[:, :, start:start + KEY_BLOCK].float() for t in (k, v))  # [b, ng, S', d]
        scores = (qg @ kb.transpose(-1, -2)).mul_(scale)  # [b, ng, g * n, S']
        scores.view(b, ng, g, n, -1).masked_fill_(~visible[:, start:start + KEY_BLOCK], float("-inf"))
        lse = scores.logsumexp(-1)  # [b, ng, g * n]
        probs = scores.sub_(torch.where(lse.isfinite(), lse, 0).unsqueeze(-1)).exp_()
        outs.append((probs @ vb).reshape(b, nh, n, d))
        lses.append(lse.reshape(b, nh, n))
    return merge(torch.stack(outs), torch.stack(lses))


def merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets from the parts' results: outs `[P, ..., d]`, lses `[P, ...]`."""
    lse = lses.logsumexp(0)
    weights = (lses - torch.where(lse.isfinite(), lse, 0)).exp()  # a part with -inf weighs 0
    return (weights.unsqueeze(-1) * outs).sum(0), lse


class CachedCoreAttention(torch.nn.Module):
    """A layer's core attention (any backend) with a KV cache; passes through unless its cache says otherwise.

    Megatron's core-attention contract: q `[n, b, nh, d]`, k/v `[n, b, ng, d]` after RoPE -> `[n, b, nh * d]`.
    """

    def __init__(self, inner: torch.nn.Module, cache: "ContextParallelKVCache", scale: float):
        super().__init__()
        self.inner, self.cache, self.scale = inner, [cache], scale  # a list: not a submodule of this one
        self.clear()

    def clear(self) -> None:
        self.keys = self.values = None  # prefill, this rank's chunks: [s_local, b, ng, d]
        self.tail_keys = self.tail_values = None  # decoded tokens, every rank: [t, b, ng, d]
        self.tail_positions = torch.empty(0, dtype=torch.long)  # [t]

    def forward(self, query, key, value, attention_mask=None, *args, **kwargs):
        cache = self.cache[0]
        if cache.mode == "decode":
            return self._decode(query, key, value, cache)
        if cache.mode == "extend":
            return self._extend(query, key, value, cache)
        if cache.mode == "record":
            # copies (`value` may be a view of the fused QKV projection), taken before the backend sees them
            self.keys, self.values = key.detach().clone(), value.detach().clone()
            self.tail_keys = self.tail_values = None
            self.tail_positions = torch.empty(0, dtype=torch.long, device=key.device)
        return self.inner(query, key, value, attention_mask, *args, **kwargs)

    def _extend(self, query, key, value, cache: "ContextParallelKVCache") -> torch.Tensor:
        s, b, nh, d = query.shape
        kept_keys, kept_values = (t.index_select(0, cache.kept_rows) for t in (self.keys, self.values))
        k_all, v_all = (cache.whole_sequence(old, new).permute(1, 2, 0, 3)  # [b, ng, start + m, d]
                        for old, new in ((kept_keys, key), (kept_values, value)))
        out = zigzag_causal_attention(self._sdpa, query.permute(1, 2, 0, 3), k_all, v_all, cache.cp_size,
                                      cache.cp_rank, prefix=cache.start)
        self.keys, self.values = torch.cat([kept_keys, key.detach()]), torch.cat([kept_values, value.detach()])
        self.tail_keys = self.tail_values = None  # decoded tokens sit after the prefix: not in the sequence now
        self.tail_positions = torch.empty(0, dtype=torch.long, device=key.device)
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * d)

    def _sdpa(self, q, k, v, mask=None):
        """q `[b, nh, sq, d]`, k/v `[b, ng, sk, d]`, `mask` a causal bias -> `[b, nh, sq, d]` (the model's dtype)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def _decode(self, query, key, value, cache: "ContextParallelKVCache") -> torch.Tensor:
        n, b, nh, d = query.shape
        new_positions = cache.new_positions.to(query.device)  # [n]
        keep = self.tail_positions < cache.start  # older decoded tokens still in the sequence
        self.tail_keys = key if self.tail_keys is None else torch.cat([self.tail_keys[keep], key])
        self.tail_values = value if self.tail_values is None else torch.cat([self.tail_values[keep], value])
        self.tail_positions = torch.cat([self.tail_positions[keep], new_positions])
        q = query.permute(1, 2, 0, 3)  # [b, nh, n, d]
        prefill_visible = (cache.prefill_positions.to(query.device) < cache.prefill_valid).expand(n, -1)  # [n, s_local]
        parts = [attend(q, *(t.permute(1, 2, 0, 3) for t in (self.keys, self.values)), prefill_visible, self.scale)]
        if cache.cp_rank == 0:
            tail_visible = self.tail_positions[None, :] <= new_positions[:, None]  # causal among the new tokens
            parts.append(attend(q, *(t.permute(1, 2, 0, 3) for t in (self.tail_keys, self.tail_values)),
                                tail_visible, self.scale))
        out, lse = merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        if cache.cp_size > 1:
            packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()  # [b, nh, n, d + 1]
            gathered = [torch.empty_like(packed) for _ in range(cache.cp_size)]
            dist.all_gather(gathered, packed, group=cache.cp_group)
            every = torch.stack(gathered)
            out, _ = merge(every[..., :d], every[..., d])
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(n, b, nh * d)


class ContextParallelKVCache:
    """The KV cache of one Megatron model chunk (this rank's layers), and the token ids it holds.

    `ids`: the tokens whose keys and values are cached, positions 0 .. len(ids) - 1 (filled by the caller after
    each pass). Install with `ContextParallelKVCache(model)`; `recording(...)` around a prefill pass,
    `decoding(...)` around a decode step.
    """

    def __init__(self, model):
        from megatron.core import parallel_state as ps

        self.cp_group = ps.get_context_parallel_group()
        self.cp_size, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        self.rotary = model.rotary_pos_emb
        self.mode: str | None = None
        self.ids: list[int] = []
        # [s_local] global positions of the prefill's rows on this rank; those before `prefill_valid` are the
        # sequence's (not padding, not a draft the decoding left), the decoded tokens' entries hold the rest
        self.prefill_positions = torch.empty(0, dtype=torch.long)
        self.prefill_valid = 0
        self.start, self.new_positions = 0, torch.empty(0, dtype=torch.long)
        self.layers = []
        for layer in model.decoder.layers:
            attention = layer.self_attention
            core = attention.core_attention
            if isinstance(core, CachedCoreAttention):  # an earlier cache's: this one replaces it
                core = core.inner
            scale = (getattr(core, "softmax_scale", None) or getattr(model.config, "softmax_scale", None)
                     or model.config.kv_channels ** -0.5)
            attention.core_attention = CachedCoreAttention(core, self, scale)
            self.layers.append(attention.core_attention)

    def shared_prefix(self, ids: list[int], first: int) -> int:
        """How many of `ids`' first positions the cache holds from its prefill (extendable by `extending`): their
        common prefix with the cached ids, at most `first` (the pass must cover the positions to predict)."""
        n = max(0, min(first, self.prefill_valid))
        return common_prefix(ids[:n], self.ids[:n])

    def reusable_prefix(self, ids: list[int], first: int, max_new: int, known_same: int = 0) -> int | None:
        """Cached positions a pass over `ids` that predicts from position `first` can reuse, or None (prefill):
        the common prefix with the cached ids, at most `first`, leaving at most `max_new` tokens to run.
        `known_same`: leading positions the caller knows hold the cached ids (not compared again)."""
        lowest = max(1, len(ids) - max_new)  # fewer reusable positions leave too many tokens for a decode step
        start = min(first, len(self.ids))
        skip = min(known_same, lowest)
        # list slices compare at C speed, but a slice of millions of ids still costs ~75 ms a copy
        if start < lowest or (skip < lowest and ids[skip:lowest] != self.ids[skip:lowest]):
            return None
        for i in range(lowest, start):  # at most `max_new` ids left to compare
            if ids[i] != self.ids[i]:
                return i
        return start

    @contextmanager
    def recording(self, prefill_positions: torch.Tensor, length: int) -> Iterator[None]:
        """A prefill pass over `length` tokens (padded beyond): every layer keeps the keys and values of this
        rank's rows, whose global positions are given."""
        self.ids = []
        self.prefill_positions, self.prefill_valid = prefill_positions, length
        self.mode = "record"
        try:
            yield
        finally:
            self.mode = None

    @contextmanager
    def extending(self, start: int, positions: torch.Tensor, length: int) -> Iterator[None]:
        """A pass over the tokens at positions `start` .. `length` - 1 (padded beyond, zigzag-split over CP like a
        prefill; this rank's rows at global `positions`) whose queries also see the cached positions before
        `start` (`start` <= what the last prefill left valid). Each layer then keeps the cached rows before
        `start` and this pass's rows; decoded tokens and cached rows from `start` on are dropped."""
        if not 0 < start <= self.prefill_valid:
            raise ValueError(f"extending from position {start}: the cache holds positions 0 .. "
                             f"{self.prefill_valid - 1}")
        keep = self.prefill_positions < start
        kept_positions = self.prefill_positions[keep]
        self.kept_rows = keep.nonzero().flatten()
        self._plan_gather(kept_positions, positions, start)
        self.start = start
        self.mode, self.rotary.positions = "extend", positions
        self.ids = []
        try:
            yield
        except BaseException:
            self.clear()  # some layers have moved on, others not
            raise
        finally:
            self.mode, self.rotary.positions = None, None
        self.prefill_positions = torch.cat([kept_positions, positions])
        self.prefill_valid = length

    def _plan_gather(self, kept_positions: torch.Tensor, positions: torch.Tensor, start: int) -> None:
        """Where each position of the sequence is in the all-gather of every CP rank's rows: its kept rows, padded
        to the largest count (ranks keep different numbers), then its rows of this pass."""
        device = kept_positions.device
        if self.cp_size == 1:
            self.kept_slots, gathered = len(kept_positions), torch.cat([kept_positions, positions])
        else:
            counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.cp_size)]
            dist.all_gather(counts, torch.tensor([len(kept_positions)], device=device), group=self.cp_group)
            self.kept_slots = int(max(c.item() for c in counts))
            padded = torch.full((self.kept_slots,), -1, dtype=torch.long, device=device)  # -1: padding
            padded[:len(kept_positions)] = kept_positions
            every = [torch.empty_like(padded) for _ in range(self.cp_size)]
            dist.all_gather(every, padded, group=self.cp_group)
            m = len(positions) * self.cp_size
            gathered = torch.cat([torch.cat([kept, start + cp_positions(m, self.cp_size, r).to(device)])
                                  for r, kept in enumerate(every)])
        order = torch.argsort(gathered)
        self.gather_order = order[gathered[order] >= 0]
        total = start + len(positions) * self.cp_size
        if not torch.equal(gathered[self.gather_order].cpu(), torch.arange(total)):
            raise RuntimeError(f"the KV cache and the pass do not hold positions 0 .. {total - 1} exactly once")

    def whole_sequence(self, kept: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """A layer's keys or values of the whole sequence `[start + m, b, ng, d]` in position order, from this
        rank's kept rows `[k, b, ng, d]` and rows of this pass `[m / CP, b, ng, d]` and every other CP rank's."""
        if self.cp_size == 1:
            return torch.cat([kept, new]).index_select(0, self.gather_order)
        mine = new.new_zeros((self.kept_slots + len(new), *new.shape[1:]))
        mine[:len(kept)], mine[self.kept_slots:] = kept, new
        every = mine.new_empty((self.cp_size * len(mine), *mine.shape[1:]))
        dist.all_gather(list(every.chunk(self.cp_size)), mine, group=self.cp_group)
        return every.index_select(0, self.gather_order)

    @contextmanager
    def decoding(self, start: int, n: int) -> Iterator[None]:
        """A decode step over `n` new tokens at positions start .. start + n - 1 (the same on every CP rank);
        cached entries at `start` and after are dropped."""
        self.start, self.new_positions = start, torch.arange(start, start + n)
        self.prefill_valid = min(self.prefill_valid, start)
        self.mode, self.rotary.positions = "decode", self.new_positions
        try:
            yield
        finally:
            self.mode, self.rotary.positions = None, None

    def clear(self) -> None:
        """Free the cached tensors (the model stays wrapped)."""
        self.ids = []
        self.prefill_positions, self.prefill_valid = self.prefill_positions[:0], 0
        for layer in self.layers:
            layer.clear()
