"""Microbatches for the training loop: which samples each rank reads at each step, CP-sharded.

CPT samples come from Megatron-Core's `GPTDataset` (`megatron_ext.data.build_cpt_datasets`), SFT
samples are packed conversations (`megatron_ext.data.SFTPackedDataset`) run as THD sequences.

Sample `i` of the run is read by exactly one DP rank: step s, microbatch m, DP rank d and row b
read sample `C + (s - s0) * G + (m * DP + d) * B + b` (G global batch, B micro batch, C the samples
consumed before step s0, where this process started: 0 and 0 for a new run, the checkpoint's count
for a resumed one). The order does not depend on DP or CP, so a resumed run reads exactly what an
uninterrupted run would have read, on any layout; after a change of G it goes on where the last
step before it stopped.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ext.context_parallel import shard_for_context_parallel
from megatron_ext.data import DataError
from megatron_ext.data.dataset_files import read_manifest
from megatron_ext.data.loaders import SFTPackedDataset, build_cpt_datasets
from megatron_ext.recipe import Recipe


class TrainBatches:
    """Deterministic per-step microbatch iterators for one (DP rank, CP rank).

    `dataset`: the samples to read (default: the train split of `recipe.data`, `build_datasets`); `device`: where
    the microbatches go (the model's device). `new_order_each_pass`: SFT training goes round its packs in a new
    order each time (`pack_of`); validation reads the same packs in the same order every time.
    """

    def __init__(self, recipe: Recipe, dp_rank: int, dp_size: int, cp_rank: int, cp_size: int,
                 first_step: int = 0, consumed_samples: int = 0, dataset=None, device: torch.device | str = "cpu",
                 new_order_each_pass: bool = True):
        t = recipe.train
        self.seed, self.new_order_each_pass = t.seed, new_order_each_pass
        self._order: tuple[int, np.ndarray | None] = (0, None)  # (pass, its pack order)
        self.device = torch.device(device)
        self.global_batch, self.micro_batch = t.global_batch_size, t.micro_batch_size
        self.first_step, self.consumed_samples = first_step, consumed_samples
        self.dp_rank, self.dp_size, self.cp_rank, self.cp_size = dp_rank, dp_size, cp_rank, cp_size
        self.stage = t.stage
        self.requested: int | None = None  # CPT: the samples asked of GPTDataset (build_batches), for checkpoints
        if dataset is None:
            self.requested = self.samples_before(t.steps)
            dataset = build_datasets(recipe, self.requested, validation=False)[0]
        self.dataset = dataset

    def samples_before(self, step: int) -> int:
        """Samples of the run read before 0-based step `step` (`step` >= the first step of this process)."""
        return self.consumed_samples + (step - self.first_step) * self.global_batch

    def sample_ids(self, step: int, microbatch: int) -> list[int]:
        """Dataset indices of this rank's rows in microbatch `microbatch` of 0-based step `step`."""
        first = self.samples_before(step) + (microbatch * self.dp_size + self.dp_rank) * self.micro_batch
        if self.stage == "sft":
            return [self.pack_of(i) for i in range(first, first + self.micro_batch)]
        return [i % len(self.dataset) for i in range(first, first + self.micro_batch)]

    def pack_of(self, sample: int) -> int:
        """SFT: the pack that sample `sample` of the run reads. Packs are few, and later steps go round them again:
        the first pass in the packs' order, each later one in its own (seeded by train.seed and the pass), so that
        no two passes repeat the same batches. A function of `sample` alone: a resumed run reads the same."""
        n = len(self.dataset)
        rounds, j = divmod(sample, n)
        if rounds == 0 or not self.new_order_each_pass:
            return j
        if self._order[0] != rounds:
            self._order = (rounds, np.random.default_rng([self.seed, rounds]).permutation(n))
        return int(self._order[1][j])

    def passes(self, steps: int) -> str | None:
        """SFT: how often a run of `steps` steps goes over its packs, for the log (None for CPT)."""
        if self.stage != "sft":
            return None
        rows = self.samples_before(steps)
        convs = sum(len(p) for p in self.dataset.packs)
        return (f"{len(self.dataset):,} packs of {convs:,} conversations; {rows:,} packs read over the run: "
                f"{rows / len(self.dataset):.2f} passes over the data (each after the first in a new order), "
                f"~{self.global_batch * convs / len(self.dataset):,.0f} conversations per step")

    def microbatch(self, step: int, microbatch: int) -> dict[str, torch.Tensor]:
        """`[B, S / CP]` tensors: tokens, labels, loss_mask, position_ids (this rank's zigzag chunks)."""
        rows = [self.dataset[i] for i in self.sample_ids(step, microbatch)]
        batch = {key: torch.stack([torch.as_tensor(r[key]) for r in rows])
                 for key in ("tokens", "labels", "loss_mask", "position_ids")}
        if self.stage == "sft":  # one pack per microbatch, attention confined to each conversation (THD)
            cu = rows[0]["cu_seqlens"]
            longest = int((cu[1:] - cu[:-1]).max())
            cu = cu.to(self.device)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            batch["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                         max_seqlen_q=longest, max_seqlen_kv=longest)
            lengths = (rows[0]["cu_seqlens"][1:] - rows[0]["cu_seqlens"][:-1]).long()  # the padding tail included
            batch["attention_pairs"] = int((lengths * (lengths + 1) // 2).sum())  # the FLOP count's causal pairs
            return batch
        local = shard_for_context_parallel(batch, self.cp_size, self.cp_rank)
        return {k: v.to(self.device) for k, v in local.items()}

    def iterator(self, step: int, num_microbatches: int) -> Iterator[dict[str, torch.Tensor]]:
        return (self.microbatch(step, m) for m in range(num_microbatches))


def build_datasets(recipe: Recipe, train_samples: int, validation: bool):
    """(train, valid) datasets of `recipe.data`: train with at least `train_samples` samples (CPT; SFT goes round
    its packs), valid (None without `validation`) with `train.eval_iters` global batches (CPT: GPTDataset repeats
    a small valid split; SFT goes round its packs)."""
    t, d = recipe.train, recipe.data
    prefix, split, G = d.prefixes[0], d.split, t.global_batch_size
    valid_samples = t.eval_iters * G if validation else None
    if t.stage == "cpt":
        tokens = sum(read_manifest(p, "cpt")["tokens"] for p in d.prefixes)
        if tokens < G * t.seq_length:
            shown = d.prefix if isinstance(d.prefix, str) else list(d.prefix)
            raise DataError(f"data.prefix = {shown!r}: {tokens} tokens, fewer than one global batch ({G} x "
                            f"{t.seq_length} = {G * t.seq_length}); prepare more data")
        sizes = [train_samples, valid_samples, None]
        if d.weights is not None:  # Megatron-Core blends by weight only to a given size: every split needs one
            sizes = [G if n is None else n for n in sizes]
        train, valid, _ = build_cpt_datasets(list(d.prefixes) if d.weights is not None else prefix, t.seq_length,
                                             cache_dir=d.cache_dir,
                                             weights=d.weights, seed=t.seed, split=split, num_samples=sizes)
        return train, valid if validation else None
    train = SFTPackedDataset(prefix, t.seq_length, seed=t.seed, split=split, part=0)
    if len(train) < t.global_batch_size:
        raise DataError(f"data.prefix = {prefix!r}: {len(train)} packed sequences of {t.seq_length} tokens, fewer "
                        f"than train.global_batch_size = {t.global_batch_size}; prepare more SFT data or lower the "
                        "global batch")
    return train, SFTPackedDataset(prefix, t.seq_length, seed=t.seed, split=split, part=1) if validation else None


def build_batches(recipe: Recipe, dp_rank: int, dp_size: int, cp_rank: int, cp_size: int, first_step: int = 0,
                  consumed_samples: int = 0, device: torch.device | str = "cpu", min_train_samples: int = 0,
                  ) -> tuple[TrainBatches, TrainBatches | None]:
    """The training batches from `first_step` on, and the validation batches (None when train.eval_interval
    is 0): validation "step" k reads the valid split's samples k x G .. (k + 1) x G - 1, split over the ranks
    as training steps are.

    CPT asks GPTDataset for max(the samples this run reads, `min_train_samples`): a resumed run passes what
    its checkpoint's run asked for, since GPTDataset's order depends on the number of epochs a request needs
    (`TrainBatches.requested` is what was asked, recorded in checkpoints)."""
    t = recipe.train
    train_samples = max(consumed_samples + (t.steps - first_step) * t.global_batch_size, min_train_samples)
    train, valid = build_datasets(recipe, train_samples, validation=t.eval_interval > 0)
    ranks = (dp_rank, dp_size, cp_rank, cp_size)
    batches = TrainBatches(recipe, *ranks, first_step, consumed_samples, dataset=train, device=device)
    batches.requested = train_samples
    return batches, None if valid is None else TrainBatches(recipe, *ranks, dataset=valid, device=device,
                                                            new_order_each_pass=False)
