"""CP-local RoPE tables: equal to Megatron's slice of the full table, rebuild CP=1 exactly, and never
allocate a tensor of global length (4M positions, CP=64)."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.presets import LLAMA31_8B, TINY
from megatron_ext.rope import ULTRALONG_ROPE, ScaledRotaryEmbedding, cp_local_positions

YARN_4M = {**LLAMA31_8B, "rope_scaling": None, "rope_parameters": ULTRALONG_ROPE["ultralong-4m"],
           "max_position_embeddings": 1 << 22}


class Rank:
    """What Megatron reads from a CP process group: size() and rank() (the real group is in
    tests/distributed/test_rope_cp.py; here we ask for every rank's slice in one process)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_zigzag_positions():
    assert cp_local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert cp_local_positions(15).tolist() == list(range(15))
    with pytest.raises(ValueError, match="divisible by 2 x CP = 8"):
        cp_local_positions(20, 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("cfg", [TINY, YARN_4M], ids=["llama3", "yarn-4m"])
def test_cp_local_table_equals_megatron_slice_and_rebuilds_cp1(cp, cfg, cpu_parallel_state):
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    seq = 1024
    emb = ScaledRotaryEmbedding(copy.deepcopy(cfg))
    full = emb.local_table(seq)  # CP=1 table [seq, 1, 1, dim]
    pieces = []
    for r in range(cp):
        local = emb.local_table(seq, cp, r)
        assert local.shape == (seq // cp, *full.shape[1:])
        assert torch.equal(local, get_pos_emb_on_this_cp_rank(full, 0, Rank(cp, r)))  # Megatron's own slicing
        pieces.append(local.chunk(2))
    # zigzag order: chunk k is held by rank k (first halves), chunk 2cp-1-k by rank k (second halves)
    rebuilt = torch.cat([p[0] for p in pieces] + [p[1] for p in reversed(pieces)])
    assert torch.equal(rebuilt, full)
    assert not torch.equal(pieces[0][0], pieces[1][0])  # negative control: the ranks' chunks differ


def test_forward_reads_the_cp_group_and_offset(cpu_parallel_state):
    from megatron_ext.model import BuildOptions, build_model

    model = build_model(TINY, BuildOptions(device="cpu", attention="sdpa", seq_length=64))
    emb = model.rotary_pos_emb
    assert torch.equal(emb(64, cp_group=Rank(4, 1)), emb.local_table(64, 4, 1))
    assert torch.equal(emb(64), emb.local_table(64))
    assert torch.equal(emb(64, offset=5), emb.local_table(69)[5:])
    assert torch.equal(emb(64, packed_seq=True, cp_group=Rank(4, 1)), emb.local_table(64))  # THD: full


class AllocationLog(TorchDispatchMode):
    """Records the shape and size in bytes of every tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
                self.nbytes.append(t.numel() * t.element_size())
        return out


def test_no_global_length_tensor_at_4m_with_cp64():
    seq, cp = 1 << 22, 64
    local = seq // cp
    emb = ScaledRotaryEmbedding(YARN_4M)
    for rank in (0, 37, 63):
        with AllocationLog() as log:
            table = emb.local_table(seq, cp, rank)
        assert table.shape == (local, 1, 1, 128)
        assert max(max(s, default=0) for s in log.shapes) <= local, "a tensor has a dimension of global length"
        biggest = max(log.nbytes)
        assert biggest <= local * 128 * 4, biggest  # the local fp32 table itself (32 MiB); the full one is 2 GiB
    print(f"4M/CP64: {len(log.shapes)} tensors, largest {biggest / 2**20:.0f} MiB, total {sum(log.nbytes) / 2**20:.0f} MiB")


def test_negative_control_megatron_stock_embedding_allocates_global_length(cpu_parallel_state):
    """Megatron's own RotaryEmbedding builds the full table before slicing (shown at 64K, CP=64)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    seq, cp = 1 << 16, 64
    stock = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, use_cpu_initialization=True, cp_group=Rank(cp, 0))
    with AllocationLog() as log:
        out = stock(seq)
    assert out.shape == (seq // cp, 1, 1, 128)
    assert max(max(s, default=0) for s in log.shapes) == seq
