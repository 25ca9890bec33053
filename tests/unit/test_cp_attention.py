"""Zigzag CP attention per chunk (lower-right causal bias) against plain causal attention of the whole sequence."""

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.attention import zigzag_causal_attention
from megatron_ext.context_parallel import cp_chunk_ids, cp_positions, shard_for_context_parallel, unshard


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _inputs(seq, heads=4, groups=2, d=8):
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(2, heads, seq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, groups, seq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def test_shard_takes_the_zigzag_chunks_of_2d_tokens_and_refuses_a_rank_outside_cp():
    """[b, s] token ids (the dataloader's tokens, labels, loss_mask) at CP=2, by hand: 8 positions in 4 chunks of 2,
    rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2. A [b] tensor and a non-tensor pass through. Rank == CP
    (one past the last) is refused, not given a duplicate of another rank's chunks."""
    tokens = torch.arange(16).reshape(2, 8)
    batch = {"tokens": tokens, "lengths": torch.tensor([8, 8]), "name": "x"}
    rank0, rank1 = (shard_for_context_parallel(batch, 2, r) for r in (0, 1))
    assert rank0["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert rank1["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert rank0["lengths"].tolist() == [8, 8] and rank0["name"] == "x"
    for bad in (2, -1):
        with pytest.raises(ValueError, match="outside"):
            cp_chunk_ids(2, bad)
        with pytest.raises(ValueError, match="outside"):
            shard_for_context_parallel(batch, 2, bad)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_unshard_restores_the_sequence_from_every_ranks_chunks(cp_size, dim):
    """What the all-gather returns (rank 0's chunks first) back in global order, along either dim; the plain
    concatenation is not (negative control), and a length that 2 x CP does not divide is refused."""
    seq = 12 * cp_size
    whole = torch.arange(3 * seq).reshape(3, seq, 1).movedim(1, dim)  # [s, 3, 1] or [3, s, 1]
    gathered = torch.cat([shard_for_context_parallel({"x": whole}, cp_size, r, seq_dim=dim)["x"]
                          for r in range(cp_size)], dim=dim)
    assert torch.equal(unshard(gathered, cp_size, dim=dim), whole)
    assert torch.equal(gathered, whole) == (cp_size == 1)
    if cp_size > 1:
        with pytest.raises(ValueError, match="not divisible by 2 x CP"):
            unshard(gathered.narrow(dim, 0, seq - 1), cp_size, dim=dim)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_ranks_together_equal_causal_attention_of_the_whole_sequence(cp_size):
    seq = 8 * cp_size * 3
    q, k, v = (t.requires_grad_() for t in _inputs(seq))
    full = _sdpa(q, k, v)  # oracle: CP = 1, is_causal
    grads_full = torch.autograd.grad(full.square().sum(), (q, k, v))
    out = torch.zeros_like(full)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp_size):
        pos = cp_positions(seq, cp_size, rank)
        ours = zigzag_causal_attention(_sdpa, q[:, :, pos], k, v, cp_size, rank)
        out[:, :, pos] = ours.detach()
        # the loss of the whole sequence is the sum over ranks, and so are its gradients
        for acc, g in zip(grads, torch.autograd.grad(ours.square().sum(), (q, k, v))):
            acc += g
    torch.testing.assert_close(out, full.detach(), rtol=0, atol=1e-12)
    for ours, ref in zip(grads, grads_full):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-11)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_a_pass_after_a_cached_prefix_equals_causal_attention_of_the_whole_sequence(cp_size):
    """The queries of the positions after a prefix (a KV cache's extension pass), zigzag-split over CP, over the
    prefix's keys and their own: the rows of SDPA over the whole sequence; without the prefix they differ."""
    prefix, rest = 13, 8 * cp_size
    q, k, v = _inputs(prefix + rest)
    full = _sdpa(q, k, v)  # oracle: the whole sequence at once, is_causal
    out = torch.zeros_like(full[:, :, prefix:])
    for rank in range(cp_size):
        pos = cp_positions(rest, cp_size, rank)  # within the pass; prefix + pos in the sequence
        out[:, :, pos] = zigzag_causal_attention(_sdpa, q[:, :, prefix + pos], k, v, cp_size, rank, prefix=prefix)
    torch.testing.assert_close(out, full[:, :, prefix:], rtol=0, atol=1e-12)
    alone = zigzag_causal_attention(_sdpa, q[:, :, prefix + cp_positions(rest, cp_size, 0)], k[:, :, prefix:],
                                    v[:, :, prefix:], cp_size, 0)  # control: the prefix's keys left out
    assert (alone - full[:, :, prefix + cp_positions(rest, cp_size, 0)]).abs().max() > 0.1


def test_upper_left_alignment_would_be_wrong():
    """Negative control: the same per-chunk split with SDPA's default (upper-left) causal mask differs."""
    cp_size, seq = 2, 32
    q, k, v = _inputs(seq)
    pos = cp_positions(seq, cp_size, 1)
    upper_left = zigzag_causal_attention(lambda q_, k_, v_, mask: _sdpa(q_, k_, v_, torch.ones(
        q_.shape[2], k_.shape[2], dtype=torch.bool).tril()), q[:, :, pos], k, v, cp_size, 1)
    ours = zigzag_causal_attention(_sdpa, q[:, :, pos], k, v, cp_size, 1)
    ref = _sdpa(q, k, v)[:, :, pos]
    torch.testing.assert_close(ours, ref)
    assert (upper_left - ref).abs().max() > 0.1


def test_cp_attention_bench_runs_at_toy_size(tmp_path):
    """bench/cp_attention_bench.py stays runnable on CPU at toy shapes; both paths give the same numbers."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "bench/cp_attention_bench.py"), "--seq", "256", "--cp", "2",
                           "--rank", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--iters", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("cp_attention-cpu-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"dense_mask", "per_chunk"} and rows["dense_mask"]["time_ratio"] == 1.0
    for row in rows.values():
        assert row["status"] == "ok" and row["peak_bytes"] > 0
        assert row["max_abs_out_diff"] < 1e-5 and row["max_abs_grad_diff"] < 1e-5
    bad = subprocess.run([sys.executable, str(ROOT / "bench/cp_attention_bench.py"), "--seq", "100", "--cp", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 1 and "--seq 100" in bad.stderr and "Traceback" not in bad.stderr
