"""Microbatches for the training loop: which samples each rank reads at each step, CP-sharded.

Sample `i` of the run is read by exactly one DP rank: step s, microbatch m, DP rank d and row b
read sample `s * G + (m * DP + d) * B + b` (G global batch, B micro batch). The order depends only
on the step, so a resumed run reads exactly what an uninterrupted run would have read.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from megatron_ext.context_parallel import shard_for_context_parallel
from megatron_ext.recipe import Recipe


class DataError(ValueError):
    """Training data that cannot serve the recipe: one line naming the file and the fix."""


def build_cpt_dataset(prefix: str, seq_length: int, num_samples: int, seed: int, split: str = "100,0,0"):
    """Megatron-Core `GPTDataset` of fixed-length samples that cross document boundaries (no document mask).

    Each sample is a dict of `[seq_length]` tensors: tokens, labels (tokens shifted by one),
    loss_mask, position_ids (0..S-1, not reset at documents, as in UltraLong).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizer

    index = IndexedDataset(prefix)
    total = int(np.asarray(index.sequence_lengths, dtype=np.int64).sum())
    if total < seq_length + 1:
        raise DataError(f"data.prefix = {prefix!r}: {total} tokens, fewer than one sequence of "
                        f"train.seq_length + 1 = {seq_length + 1}; prepare more data or shorten the sequence")
    # The tokenizer only supplies the EOD/pad ids that GPTDataset asks for; with no document
    # masking and no padding their value does not matter.
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=2**31 - 1)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=split,
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=None,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    return train, total


class TrainBatches:
    """Deterministic per-step microbatch iterators for one (DP rank, CP rank)."""

    def __init__(self, recipe: Recipe, dp_rank: int, dp_size: int, cp_rank: int, cp_size: int):
        t = recipe.train
        self.global_batch, self.micro_batch = t.global_batch_size, t.micro_batch_size
        self.dp_rank, self.dp_size, self.cp_rank, self.cp_size = dp_rank, dp_size, cp_rank, cp_size
        if t.stage != "cpt":
            raise DataError(f"train.stage = {t.stage!r}: SFT data is not wired into the trainer yet")
        self.dataset, tokens = build_cpt_dataset(recipe.data.prefix, t.seq_length, t.steps * t.global_batch_size,
                                                 t.seed, recipe.data.split)
        needed = t.global_batch_size * t.seq_length
        if tokens < needed:
            raise DataError(f"data.prefix = {recipe.data.prefix!r}: {tokens} tokens, fewer than one global batch "
                            f"({t.global_batch_size} x {t.seq_length} = {needed}); prepare more data")

    def sample_ids(self, step: int, microbatch: int) -> list[int]:
        """Dataset indices of this rank's rows in microbatch `microbatch` of 0-based step `step`."""
        first = step * self.global_batch + (microbatch * self.dp_size + self.dp_rank) * self.micro_batch
        return list(range(first, first + self.micro_batch))

    def microbatch(self, step: int, microbatch: int) -> dict[str, torch.Tensor]:
        """`[B, S / CP]` tensors: tokens, labels, loss_mask, position_ids (this rank's zigzag chunks)."""
        rows = [self.dataset[i] for i in self.sample_ids(step, microbatch)]
        batch = {key: torch.stack([torch.as_tensor(r[key]) for r in rows])
                 for key in ("tokens", "labels", "loss_mask", "position_ids")}
        return shard_for_context_parallel(batch, self.cp_size, self.cp_rank)

    def iterator(self, step: int, num_microbatches: int) -> Iterator[dict[str, torch.Tensor]]:
        return (self.microbatch(step, m) for m in range(num_microbatches))
