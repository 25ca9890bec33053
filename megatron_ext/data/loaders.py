"""Reader side for the trainer: CPT through Megatron-Core's `GPTDataset`, SFT packed sequences.

CPT batch (one sample of `build_cpt_datasets(...)[0]`, Megatron-Core's own dict, S = seq_length):
    tokens        int64   [S]   corpus tokens, crossing document boundaries (no document mask)
    labels        int64   [S]   tokens shifted by one (Megatron draws S + 1 tokens per sample)
    loss_mask     float32 [S]   all ones
    position_ids  int64   [S]   0..S-1 (not reset at separators: the paper attends across documents)
A DataLoader stacks these to [B, S].

SFT batch (one sample of `SFTPackedDataset`, n = number of conversations packed in it):
    tokens        int64   [S]   conversations back to back, then `pad_id` up to S
    labels        int64   [S]   next token within the same conversation; `pad_id` where there is none
                                (last token of each conversation, padding): always a valid id
    loss_mask     float32 [S]   1 where the label is an assistant token (content + <|eot_id|>), else 0
    position_ids  int64   [S]   0.. restarting at each conversation (and at the padding tail)
    cu_seqlens    int32   [m+1] segment starts and S at the end; m = n, plus 1 when there is a
                                padding tail (kept as its own segment so cu_seqlens[-1] == S)
    num_samples   int64   []    n
`collate_packed` stacks a list of those into [B, S] tensors, pads cu_seqlens to [B, max m + 1]
with -1 (Megatron-LM's convention for packed batches) and adds max_seqlen int32 [B].
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from megatron_ext.data.common import DataError, split_fractions, split_range
from megatron_ext.data.dataset_files import (check_complete, check_index_caches, check_sft_masks, index_cache_folder,
                                             index_fingerprint, read_manifest)
from megatron_ext.data.sft import pack_samples
from megatron_ext.runtime.distributed import alike_on_every_rank, rank_zero_outcome


class _ManifestTokenizer:
    """What GPTDataset needs of a tokenizer (vocab size for the token dtype, an eod id, an identity
    for its index cache), taken from the manifest so training nodes need no tokenizer files."""

    def __init__(self, manifest: dict, index_fingerprint: str) -> None:
        self.vocab_size = int(manifest["vocab_size"])
        suffix = manifest.get("separator_ids", {}).get("suffix") or [0]
        # Unused (position ids and masks are not reset at documents) but must differ from the
        # never-occurring pad id -1, or GPTDataset warns about a collision.
        self.eod = int(suffix[-1])
        # Megatron-Core names its index caches by path and settings, not content: without the
        # fingerprint, data re-prepared under the same PREFIX would reuse the old corpus's indices.
        self.unique_identifiers = {"class": "ManifestTokenizer", "tokenizer_hash": manifest["tokenizer_hash"],
                                   "vocab_size": self.vocab_size, "index_fingerprint": index_fingerprint}

    @property
    def pad(self) -> int:
        raise AttributeError("no pad: GPTDataset then uses an id that never occurs")


def build_cpt_datasets(prefixes: str | Sequence[str], seq_length: int, *, weights: Sequence[float] | None = None,
                       seed: int = 1234, num_samples: Sequence[int | None] = (None, None, None),
                       split: str | None = None, cache_dir: str | None = None,
                       is_built_on_rank: Callable[[], bool] = lambda: True) -> list:
    """Megatron-Core `GPTDataset`s (train, valid, test; None where a split is empty) over CPT data.

    `prefixes`: one PREFIX or several blended with `weights` (then `num_samples[0]` is required).
    `split`: None puts all data in train (valid/test None); else Megatron's "98,2,0" style split.
    `num_samples[i]` None means one epoch. Index caches go to `cache_dir` (default: PREFIX's
    folder/cache). Under torch.distributed, rank 0 builds the caches first, alone, written whole or not at all
    (`index_caches`); a write that failed (a full disk, a quota) is raised as rank 0's DataError on every rank, then
    the others load them. Outside torch.distributed a weighted blend builds its blend index in
    memory and GPTDataset caches go to PREFIX/cache, because Megatron-Core's BlendedDataset
    cache path calls torch.distributed.get_rank().
    Raises DataError when a corpus is too small for one sequence or tokenizers differ, or when a `.npy` in the
    cache folder is not a plain array (a pickle there would run in Megatron-Core's numpy.load: `check_index_caches`).
    """
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_ext.data.index_caches import DatasetBuilder

    prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    if weights is not None and len(weights) != len(prefixes):
        raise DataError(f"data weights {list(weights)}: {len(weights)} weights for {len(prefixes)} prefixes")
    if weights is not None and num_samples[0] is None:
        raise DataError("data weights need a number of training samples (num_samples[0]), as Megatron-Core requires")
    blend = (prefixes, list(weights) if weights is not None else None)
    cache = index_cache_folder(prefixes, cache_dir)
    if len(prefixes) > 1 and not torch.distributed.is_initialized():
        cache = None
    # where Megatron-Core reads index caches: path_to_cache, or (None) its default beside each GPTDataset's prefix
    cache_folders = [cache] if cache else [str(Path(p, "cache", f"{GPTDataset.__name__}_indices")) for p in prefixes]
    manifest, fingerprint = _rank_zero_checks(prefixes, seq_length, split, cache_folders)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        **({"blend_per_split": [blend, None, None]} if split is None else {"blend": blend, "split": split}),
        path_to_cache=cache,
        tokenizer=_ManifestTokenizer(manifest, fingerprint),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,  # causal attention is implied; [S, S] masks at 1M tokens would not fit
    )
    distributed = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    # Rank 0 builds first, the others pass Megatron-Core's barriers with it (is_built_on_rank false: its way for
    # ranks without data). Its cache writes do not raise there: rank 0 leaving the builder early left the others
    # waiting in a barrier. A failure is told to every rank after it.
    builder = DatasetBuilder(list(num_samples), lambda: rank == 0, config)
    first = builder.build()
    problem = rank_zero_outcome(builder.writes.said, DataError)[0]
    if problem is not None:
        raise alike_on_every_rank(DataError(problem))
    if not distributed:
        return first
    # now a cache hit on the other ranks (they write nothing); rank 0 keeps what it built (its part in the barriers)
    second = DatasetBuilder(list(num_samples), lambda: rank != 0 and is_built_on_rank(), config)
    rest = second.build()
    if (problem := second.writes.said()) is not None:  # its datasets hold placeholders; none writes here, though
        raise DataError(problem)
    return (first if is_built_on_rank() else [None] * len(first)) if rank == 0 else rest


def _rank_zero_checks(prefixes: list[str], seq_length: int, split: str | None,
                      cache_folders: list[str]) -> tuple[dict, str]:
    """(the first prefix's manifest, `index_fingerprint(prefixes)`) once every prefix is whole, of one tokenizer, long
    enough for a sequence in each split, `check_index_caches(cache_folders)` passed and the folders made: all by
    rank 0 alone under torch.distributed, the result sent to the others, which raise rank 0's DataError alike (said
    once). Every rank names GPTDataset's index caches with the fingerprint, and an .idx of 100B tokens is 1-2 GB
    (hashed by each of 512 ranks: up to 128 GB off the shared file system at each start, once per node of 8), its
    document lengths 200 MB; the cache folder is Megatron-Core's shared one, whose files rank 0 builds first. Collective, as the
    dataset builder is."""
    def checks() -> tuple[dict, str]:
        manifests = [read_manifest(p, "cpt") for p in prefixes]
        for p, m in zip(prefixes, manifests):
            if m["tokenizer_hash"] != manifests[0]["tokenizer_hash"]:
                raise DataError(f"data prefix {p}: tokenized with a different tokenizer than {prefixes[0]} "
                                f"({m['tokenizer_hash'][:19]} vs {manifests[0]['tokenizer_hash'][:19]}); re-prepare it")
            if m["tokens"] < seq_length + 1:
                raise DataError(f"data prefix {p}: {m['tokens']} tokens, but one sequence of seq_length {seq_length} "
                                f"needs {seq_length + 1}: {seq_length + 1 - m['tokens']} tokens missing")
        for p in prefixes:
            index = check_complete(p)
            if split is not None:  # the lengths are read only then (4 bytes a document)
                _check_split_sizes(p, np.array(index.sequence_lengths, dtype=np.int64), seq_length, split)
        try:
            fingerprint = index_fingerprint(prefixes)
        except OSError as e:
            raise DataError(f"data prefixes {prefixes}: cannot read {e.filename} ({e.strerror})") from None
        check_index_caches(cache_folders)  # before Megatron-Core's builder numpy.load()s any of them
        _make_cache_folders(cache_folders)
        return manifests[0], fingerprint

    found, problem = rank_zero_outcome(checks, DataError)
    if problem is not None:
        raise alike_on_every_rank(DataError(problem))
    return found


def _make_cache_folders(folders: list[str]) -> None:
    """Make the index-cache folders (Megatron-Core makes them on rank 0 inside its builder, where a failure left the
    other ranks waiting in a barrier); DataError naming the folder, the space left and the fix."""
    from megatron_ext.disk_space import no_space_message

    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise DataError(no_space_message(e, f"data cache folder {folder}", folder, "it could not be made",
                                             "free space there or set data.cache_dir to a folder with room")
                            or f"data cache folder {folder}: cannot be made ({e.strerror or e}); set data.cache_dir "
                               "to a folder this job can write") from None


def _check_split_sizes(prefix: str, lengths: np.ndarray, seq_length: int, split: str) -> None:
    """Every split of a positive weight holds one sequence's tokens: Megatron-Core's GPTDataset loops forever
    over a split without tokens (epochs of 0 tokens never reach a sample) and has no sample in one too short.
    `lengths`: the document lengths of `prefix`."""
    for part, (name, fraction) in enumerate(zip(("train", "valid", "test"), split_fractions(split))):
        docs = split_range(lengths.size, split, part)
        tokens = int(lengths[docs.start:docs.stop].sum())
        if fraction > 0 and tokens < seq_length + 1:
            raise DataError(f"data.split = {split!r}: the {name} split of data prefix {prefix} holds {len(docs)} of "
                            f"{lengths.size} documents, {tokens} tokens, fewer than one sequence of seq_length "
                            f"{seq_length} needs ({seq_length + 1}); give it a larger weight"
                            + (f" or set its weight to 0{' and train.eval_interval=0' if part == 1 else ''}"
                               if part else ""))


class SFTPackedDataset(torch.utils.data.Dataset):
    """Packed SFT sequences of `seq_length` tokens from a `prepare_data.py sft` PREFIX (see module doc).

    Packing (`pack_samples`) is deterministic in `seed`; conversations longer than `seq_length`
    (possible when reading at a shorter length than prepared) are left out and counted in `dropped`.
    `split` ("98,2,0") and `part` (0 train, 1 valid, 2 test): pack only that split's conversations
    (`split_range`: consecutive ranges, as GPTDataset splits CPT documents); None: all of them.
    """

    def __init__(self, prefix: str, seq_length: int, seed: int = 1234, split: str | None = None,
                 part: int = 0) -> None:
        self.manifest = read_manifest(prefix, "sft")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        check_sft_masks(prefix)  # both whole, of equal lengths: Megatron-Core's reader would fail bare or late
        self.tokens = IndexedDataset(prefix)
        self.masks = IndexedDataset(prefix + "_lossmask")
        lengths = self.tokens.sequence_lengths
        self.seq_length = seq_length
        self.pad_id = int(self.manifest["pad_id"])
        docs = range(lengths.size) if split is None else split_range(lengths.size, split, part)
        chosen = np.arange(docs.start, docs.stop)
        keep = chosen[lengths[chosen] <= seq_length]
        self.dropped = int(chosen.size - keep.size)
        if self.dropped:
            warnings.warn(f"{prefix}: {self.dropped} conversations longer than seq_length {seq_length} left out")
        if split is not None and chosen.size == 0:
            raise DataError(f"data.split = {split!r}: leaves the {('train', 'valid', 'test')[part]} split of data "
                            f"prefix {prefix} ({lengths.size} conversations) empty; give it a larger weight")
        if keep.size == 0:
            raise DataError(f"data prefix {prefix}: no conversation fits seq_length {seq_length}")
        self.packs = [[int(keep[j]) for j in p] for p in pack_samples(lengths[keep], seq_length, seed)]

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        S = self.seq_length
        tokens = np.full(S, self.pad_id, dtype=np.int64)
        labels = np.full(S, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(S, dtype=np.float32)
        position_ids = np.zeros(S, dtype=np.int64)
        cu = [0]
        for i in self.packs[idx]:
            t = self.tokens[i].astype(np.int64)  # [n]
            m = self.masks[i]  # [n] uint8, 1 on assistant tokens
            a, b = cu[-1], cu[-1] + t.size
            tokens[a:b] = t
            labels[a:b - 1] = t[1:]  # the label at position p is token p+1 of the same conversation
            loss_mask[a:b - 1] = m[1:]
            position_ids[a:b] = np.arange(t.size)
            cu.append(b)
        n = len(cu) - 1
        if cu[-1] < S:  # padding tail: its own segment so attention never mixes it with a sample
            position_ids[cu[-1]:] = np.arange(S - cu[-1])
            cu.append(S)
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.from_numpy(position_ids),
                "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "num_samples": torch.tensor(n)}


def collate_packed(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack SFT samples: [B, S] tensors, cu_seqlens [B, max m + 1] padded with -1, max_seqlen [B]."""
    out = {k: torch.stack([b[k] for b in batch]) for k in ("tokens", "labels", "loss_mask", "position_ids",
                                                          "num_samples")}
    width = max(b["cu_seqlens"].numel() for b in batch)
    cu = torch.full((len(batch), width), -1, dtype=torch.int32)
    for r, b in enumerate(batch):
        cu[r, : b["cu_seqlens"].numel()] = b["cu_seqlens"]
    out["cu_seqlens"] = cu
    out["max_seqlen"] = torch.stack([(b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).max() for b in batch]).int()
    return out
