"""Context parallelism: load-balanced (zigzag) sharding of a batch along the sequence.

With causal attention, the first positions of a sequence attend to little and the last to a lot.
Splitting the sequence into 2 x CP chunks and giving rank r chunks r and 2*CP-1-r gives every rank
the same attention work (Megatron-Core's and Transformer Engine's convention, which their
attention kernels and RoPE slicing expect).
"""

from __future__ import annotations

import torch


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2 x CP sequence chunks that rank `cp_rank` holds."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions `[seq_len / cp_size]` held by `cp_rank`, in local order."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x CP = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in cp_chunk_ids(cp_size, cp_rank)])


def shard_for_context_parallel(batch: dict[str, torch.Tensor], cp_size: int, cp_rank: int,
                               seq_dim: int = 1) -> dict[str, torch.Tensor]:
    """Keep this rank's zigzag chunks of every `[b, s, ...]` tensor in `batch` (others pass through)."""
    if cp_size == 1:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim:
            index = cp_positions(value.shape[seq_dim], cp_size, cp_rank).to(value.device)
            out[key] = value.index_select(seq_dim, index)
        else:
            out[key] = value
    return out


def unshard(gathered: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Every rank's local chunks concatenated along `dim` (rank 0 first) -> the sequence in global order.

    One copy of views (rank r's first chunk is global chunk r, its second chunk 2 x CP - 1 - r): no index
    tensor, which at 4M positions took a CPU sort per layer. Differentiable.
    """
    if cp_size == 1:
        return gathered
    seq_len = gathered.shape[dim]
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x CP = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    firsts = [gathered.narrow(dim, 2 * r * chunk, chunk) for r in range(cp_size)]
    seconds = [gathered.narrow(dim, (2 * r + 1) * chunk, chunk) for r in reversed(range(cp_size))]
    return torch.cat(firsts + seconds, dim=dim)
