"""The files of a prepared dataset PREFIX, read and checked with numpy alone: the manifest, the index, sizes.

The pre-launch check (`launch --check`, run by every sbatch script before srun, and by the submitit launcher
on the login node) and the resume report read datasets here, so that they import neither torch nor
Megatron-Core (~8 s of CPU per check). The trainer reads tokens through Megatron-Core's `IndexedDataset` after
`check_complete` has vouched for the files, so that a bad file is one clear message, not Megatron-Core's bare
AssertionError or struct.error, or a short read mid-training.

The index format (PREFIX.idx, Megatron-Core's `IndexedDatasetBuilder`, little-endian):
    9 bytes  b"MMIDIDX\\x00\\x00"
    u64      version, 1
    u8       token dtype code (INDEX_DTYPES)
    u64      n  sequences (our documents)
    u64      d  document indices (n + 1: 0..n)
    i32 [n]  sequence lengths, in tokens
    i64 [n]  sequence pointers, byte offsets into PREFIX.bin
    i64 [d]  document indices
    (i8 [n]  sequence modes, multimodal datasets only)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_ext.data.common import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
INDEX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                8: np.uint16}  # Megatron-Core's DType codes
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents: 34 bytes


@dataclass(frozen=True)
class IndexFile:
    """PREFIX.idx as arrays (read-only views of a memory map of the file)."""

    dtype: np.dtype                 # of the tokens in PREFIX.bin
    sequence_lengths: np.ndarray    # int32 [n]
    sequence_pointers: np.ndarray   # int64 [n]
    document_indices: np.ndarray    # int64 [d]

    def bin_bytes_needed(self) -> int:
        """The size PREFIX.bin must have at least: the end of its last sequence."""
        if not len(self.sequence_lengths):
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize


def read_index(path: str | Path) -> IndexFile:
    """Parse a Megatron indexed dataset's .idx file; ValueError saying what is wrong with it (a copy cut short,
    a full disk, another file under the name)."""
    size = Path(path).stat().st_size
    if size < _HEADER.size:
        raise ValueError(f"{size} bytes, shorter than the {_HEADER.size}-byte header")
    with open(path, "rb") as f:
        magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
    if magic != INDEX_MAGIC:
        raise ValueError(f"bad header {magic!r}, not a Megatron indexed dataset index")
    if version != INDEX_VERSION:
        raise ValueError(f"index version {version}, this reader knows {INDEX_VERSION}")
    if code not in INDEX_DTYPES:
        raise ValueError(f"unknown token dtype code {code}")
    needed = _HEADER.size + n * (4 + 8) + d * 8
    if size not in (needed, needed + n):  # + n: the sequence modes of a multimodal index
        raise ValueError(f"{size} bytes, but its header's {n} sequences and {d} document indices take {needed}")
    buffer = np.memmap(path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(buffer, dtype=np.int32, count=n, offset=_HEADER.size)
    pointers = np.frombuffer(buffer, dtype=np.int64, count=n, offset=_HEADER.size + 4 * n)
    documents = np.frombuffer(buffer, dtype=np.int64, count=d, offset=_HEADER.size + 12 * n)
    return IndexFile(np.dtype(INDEX_DTYPES[code]), lengths, pointers, documents)


def check_complete(prefix: str) -> IndexFile:
    """PREFIX.idx parsed, and PREFIX.bin as long as the index says; DataError naming the file that is truncated
    or corrupt (Megatron-Core's reader notices a short .bin only when a missing document is read, mid-training)."""

    def corrupt(path: str, what: str) -> DataError:
        return DataError(f"data prefix {prefix}: {path} is truncated or corrupt ({what}); prepare the data again "
                         "(tools/prepare_data.py)")

    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise DataError(f"data prefix {prefix}: {prefix + suffix} not found; run tools/prepare_data.py first")
    size = Path(prefix + ".bin").stat().st_size
    if size == 0:  # numpy cannot map an empty file
        raise corrupt(prefix + ".bin", "0 bytes")
    try:
        index = read_index(prefix + ".idx")
    except ValueError as e:
        raise corrupt(prefix + ".idx", str(e)) from None
    if size < index.bin_bytes_needed():
        raise corrupt(prefix + ".bin", f"{size} bytes, its index points up to byte {index.bin_bytes_needed()}")
    return index


def check_sft_masks(prefix: str) -> None:
    """An SFT dataset's tokens and PREFIX_lossmask.bin/.idx complete, one mask per conversation of its length."""
    tokens, masks = check_complete(prefix), check_complete(prefix + "_lossmask")
    if not np.array_equal(tokens.sequence_lengths, masks.sequence_lengths):
        raise DataError(f"data prefix {prefix}: tokens and loss masks disagree in length; re-prepare it")


def read_manifest(prefix: str, kind: str | None = None) -> dict:
    """The PREFIX.json manifest; DataError when the dataset is missing, incomplete or of another kind."""
    for suffix in (".bin", ".idx", ".json"):
        if not Path(prefix + suffix).is_file():
            raise DataError(f"data prefix {prefix}: {prefix + suffix} not found; run tools/prepare_data.py first")
    try:
        manifest = json.loads(Path(prefix + ".json").read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"data prefix {prefix}: {prefix}.json is truncated or corrupt ({e}); prepare the data "
                        "again (tools/prepare_data.py)") from None
    if kind is not None and manifest.get("kind") != kind:
        raise DataError(f"data prefix {prefix}: a {manifest.get('kind')!r} dataset, expected {kind!r}; "
                        f"prepare it with `prepare_data.py {kind}`")
    return manifest


def check_token_ids(prefix: str, manifest: dict, vocab_size: int) -> None:
    """DataError unless every token id of the dataset has an embedding row among the model's `vocab_size`: a
    larger id fails only at the first forward step, as a bare IndexError from the embedding (CPU) or a device-side
    assert (CUDA). The manifest records the largest id (`max_token_id`; older ones only the tokenizer's size)."""
    largest = manifest.get("max_token_id", int(manifest["vocab_size"]) - 1)
    if largest < vocab_size:
        return
    what = ("holds token ids up to" if "max_token_id" in manifest else "was tokenized with ids up to")
    raise DataError(f"data prefix {prefix} {what} {largest} (tokenizer {manifest.get('tokenizer')}, "
                    f"{manifest['vocab_size']} ids), but model.vocab_size = {vocab_size} has rows for ids 0.."
                    f"{vocab_size - 1} only; set model.vocab_size to the model's tokenizer size (at least "
                    f"{largest + 1}), or prepare the data with the model's tokenizer")
