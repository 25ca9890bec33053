"""The files of a prepared dataset PREFIX, read and checked with numpy alone: the manifest, the index, sizes, and
the identity of the contents that a checkpoint records.

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

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
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


def missing_file(prefix: str, suffix: str) -> str:
    """Why PREFIX+suffix is missing and the fix (the caller names the field): when PREFIX names one of the
    dataset's files (`data/cpt.bin`), the fix is the prefix itself, as every reader appends .bin/.idx/.json."""
    for ext in (".bin", ".idx", ".json"):
        if prefix.endswith(ext):
            return (f"{prefix + suffix} not found; a data prefix names the dataset without its .bin/.idx/.json "
                    f"ending: give {prefix[: -len(ext)]}")
    return f"{prefix + suffix} not found; run tools/prepare_data.py first"


def check_complete(prefix: str) -> IndexFile:
    """PREFIX.idx parsed, and PREFIX.bin as long as the index says; DataError naming the file that is truncated
    or corrupt (Megatron-Core's reader notices a short .bin only when a missing document is read, mid-training)."""

    def corrupt(path: str, what: str) -> DataError:
        return DataError(f"data prefix {prefix}: {path} is truncated or corrupt ({what}); prepare the data again "
                         "(tools/prepare_data.py)")

    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise DataError(f"data prefix {prefix}: {missing_file(prefix, suffix)}")
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


def loss_mask_owner(prefix: str) -> str | None:
    """The SFT dataset whose loss mask PREFIX is (PREFIX = DATASET_lossmask, without a manifest of its own, beside
    DATASET.json of kind sft), or None."""
    suffix = "_lossmask"  # what `prepare_data.py sft` writes (its manifest's loss_mask_prefix_suffix)
    if not prefix.endswith(suffix) or Path(prefix + ".json").exists():
        return None
    owner = prefix[: -len(suffix)]
    try:
        manifest = json.loads(Path(owner + ".json").read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("kind") != "sft":
        return None
    return owner


def read_manifest(prefix: str, kind: str | None = None) -> dict:
    """The PREFIX.json manifest; DataError when the dataset is missing, incomplete or of another kind."""
    owner = loss_mask_owner(prefix)
    if owner is not None:  # its .bin/.idx are there, its manifest is the dataset's: 'PREFIX.json not found' misled
        raise DataError(f"data.prefix = {prefix!r} is the loss mask of the SFT dataset {owner}; give "
                        f"data.prefix={owner}")
    for suffix in (".bin", ".idx", ".json"):
        if not Path(prefix + suffix).is_file():
            raise DataError(f"data prefix {prefix}: {missing_file(prefix, suffix)}")
    try:
        manifest = json.loads(Path(prefix + ".json").read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"data prefix {prefix}: {prefix}.json is truncated or corrupt ({e}); prepare the data "
                        "again (tools/prepare_data.py)") from None
    problem = _manifest_problem(manifest)
    if problem:  # the trainer and the loaders read these fields: a KeyError or AttributeError there said nothing
        raise DataError(f"data prefix {prefix}: {prefix}.json is not a dataset manifest ({problem}); prepare the "
                        "data again (tools/prepare_data.py)")
    if kind is not None and manifest.get("kind") != kind:
        raise DataError(f"data prefix {prefix}: a {manifest.get('kind')!r} dataset, expected {kind!r}; "
                        f"prepare it with `prepare_data.py {kind}`")
    return manifest


# The manifest fields read as they are (count, check, key the index caches), of every kind and of one kind; both
# `prepare_data.py` commands have written all of them since the first format version.
_MANIFEST_INTS = ("vocab_size", "documents", "tokens")
_MANIFEST_KIND_INTS = {"sft": ("pad_id",)}


def _manifest_problem(manifest: object) -> str | None:
    """What makes a parsed PREFIX.json unusable as a manifest, in a few words; None when nothing does."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if manifest.get("kind") not in ("cpt", "sft"):
        return f"kind {manifest.get('kind')!r}, not 'cpt' or 'sft'" if "kind" in manifest else "no kind"
    if not isinstance(manifest.get("tokenizer_hash"), str):
        return "no tokenizer_hash" if "tokenizer_hash" not in manifest else "tokenizer_hash is not a string"
    optional = ("max_token_id",) if "max_token_id" in manifest else ()
    for key in _MANIFEST_INTS + _MANIFEST_KIND_INTS.get(manifest["kind"], ()) + optional:
        if key not in manifest:
            return f"no {key}"
        value = manifest[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"{key} = {value!r}, not a whole number"
    return None


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


_DIGESTS: dict[tuple, str] = {}  # this process's sha256 of each file hashed, by (path, device, inode, size, mtime)


def _file_sha256(path: str) -> str:
    """sha256 (hex) of a file's bytes, read once per process while it is the same file (inode, size, mtime): the
    trainer's rank 0 needs each index's for the data identity and again for the index caches, and at 100B tokens
    an .idx is 1-2 GB. Data prepared again is new files (written beside the old, then renamed): another inode."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def index_fingerprint(prefixes: Sequence[str]) -> str:
    """sha256 of the PREFIX.idx file ("sha256:..."; of several, over their sha256s in order): the document lengths
    that GPTDataset's cached indices (document, sample and shuffle index) are computed from."""
    digests = [_file_sha256(p + ".idx") for p in prefixes]
    return "sha256:" + (digests[0] if len(digests) == 1 else hashlib.sha256(" ".join(digests).encode()).hexdigest())


def index_cache_folder(prefixes: Sequence[str], cache_dir: str | None) -> str:
    """Where a training run's GPTDataset index caches go (`data.cache_dir`, else `cache/` beside the first prefix):
    the trainer's dataset builder, its setup check and `launch --check` name the same folder."""
    return cache_dir or str(Path(prefixes[0]).parent / "cache")


def check_index_caches(folders: Sequence[str]) -> None:
    """Raise DataError naming the first `*.npy` file in `folders` that is not a plain .npy array: Megatron-Core
    loads GPTDataset's and BlendedDataset's index caches (FOLDER/<md5>-<class>-<split>-<name>.npy) with
    `numpy.load(allow_pickle=True)`, which runs the code in a file that is really a pickle, on every rank.

    Every `.npy` there is vetted, other runs' too: this build's names hash its whole dataset description (sample
    counts the builder derives), known only inside Megatron-Core's builder. A file is read up to the end of its
    .npy header (~128 bytes), the data is not mapped. Passes: an empty file, or a .npy whose data is short of its
    shape (numpy raises on those without unpickling anything; the build replaces one of its own caches cut short,
    `npy_is_whole`, and another run's is not read)."""
    for folder in folders:
        try:
            names = sorted(e.name for e in os.scandir(folder) if e.name.endswith(".npy") and e.is_file())
        except (FileNotFoundError, NotADirectoryError):
            continue  # no caches yet (a path that is a file: Megatron-Core's own error when it saves)
        except OSError as e:
            raise DataError(f"data cache folder {folder}: cannot be listed ({e.strerror})") from None
        for name in names:
            path = os.path.join(folder, name)
            try:
                problem = _npy_problem(path)
            except OSError as e:
                problem = f"cannot be read ({e.strerror})"
            if problem:
                raise DataError(f"data cache file {path}: {problem}, and Megatron-Core loads its index caches with "
                                "numpy.load(allow_pickle=True), which runs the code in a pickle; delete it (or the "
                                f"cache folder {folder}): the run rebuilds its index caches")


def _npy_problem(path: str) -> str | None:
    """Why `numpy.load(path, mmap_mode="r", allow_pickle=True)` would not be a plain array read, or None."""
    with open(path, "rb") as f:
        magic = f.read(len(np.lib.format.MAGIC_PREFIX))
        if not magic:
            return None
        if magic != np.lib.format.MAGIC_PREFIX:
            return "is not a .npy array (a pickle, or another format)"
        f.seek(0)
        try:
            header = _npy_header(f)
        except ValueError as e:
            return f"has a broken .npy header ({e})"
        if isinstance(header, str):
            return header
    return "holds Python objects (pickled data)" if header[1].hasobject else None


def _npy_header(f) -> tuple[tuple[int, ...], np.dtype] | str:
    """(shape, dtype) from the header of the .npy file `f` (at its start), or why it is not one Megatron-Core writes;
    ValueError where the header is broken. `f` is left at the data's start."""
    version = np.lib.format.read_magic(f)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read_header is None:
        return f"is a .npy of format version {version[0]}.{version[1]}, which Megatron-Core does not write"
    shape, _, dtype = read_header(f)
    return shape, dtype


def npy_is_whole(path: str) -> bool:
    """Whether the .npy file at `path` holds all the data its header announces (a write cut short by a kill or a full
    disk does not); False when it cannot be read as a plain .npy."""
    try:
        with open(path, "rb") as f:
            header = _npy_header(f)
            data_start = f.tell()
        if isinstance(header, str):
            return False
        shape, dtype = header
        return os.path.getsize(path) >= data_start + math.prod(shape) * dtype.itemsize
    except (OSError, ValueError):
        return False


SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 1 << 16


def sample_offsets(size: int, blocks: int = SAMPLE_BLOCKS, block_bytes: int = SAMPLE_BLOCK_BYTES) -> list[int]:
    """Where `sampled_fingerprint` reads `block_bytes` each in a file of `size` bytes: `blocks` (at least 2) evenly
    spaced, non-overlapping offsets from the first block to the last (ending at the file's end); for a file of at
    most `blocks * block_bytes`, every block's, so that it is read whole."""
    if blocks < 2:
        raise ValueError(f"blocks = {blocks}: at least 2, the first and the last")
    if size <= blocks * block_bytes:
        return list(range(0, size, block_bytes))
    last = size - block_bytes
    return [i * last // (blocks - 1) for i in range(blocks)]


def sampled_fingerprint(path: str | Path, blocks: int = SAMPLE_BLOCKS, block_bytes: int = SAMPLE_BLOCK_BYTES) -> str:
    """sha256 ("sha256:...") over the file's size (8 bytes, little-endian) and its `sample_offsets` blocks: at most
    `blocks * block_bytes` read (4 MiB by default) whatever the size, so that a terabyte .bin costs the same at
    every start. Depends on the contents only (not the path or times). Blind to a change confined to the bytes
    between the sampled blocks; a file of at most `blocks * block_bytes` is hashed whole."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # The size first: the offsets depend on it, and files of other sizes must not hash alike by their blocks.
        h = hashlib.sha256(size.to_bytes(8, "little"))
        for offset in sample_offsets(size, blocks, block_bytes):
            f.seek(offset)
            h.update(f.read(block_bytes))
    return "sha256:" + h.hexdigest()


def data_identity(prefix: str) -> dict | None:
    """What a checkpoint records of dataset PREFIX, so that a resume notices data prepared again under the same
    prefix; None when it cannot be read (gone, incomplete): then nothing is recorded or compared.

    The contents, not the files' times, so the same data prepared again identically has the same identity: the
    sha256 of PREFIX.idx (every document's length and offset, ~20 bytes a document: tens of MB for 1B tokens, read
    once at a run's start), the size of PREFIX.bin, a sampled fingerprint of PREFIX.bin (`sampled_fingerprint`:
    64 blocks of 64 KiB evenly spaced over the file, first and last included, the whole file up to 4 MiB; reading
    all the tokens at every start is too expensive), the manifest's counts, for the warning, and tokenizer hash.
    The sample tells other tokens of the same document lengths (fixed-length packed documents, another shuffle)
    and the tokenizer hash other token ids; a change confined to bytes between the sampled blocks goes unseen.
    """
    try:
        manifest = read_manifest(prefix)
        return {"idx_sha256": index_fingerprint([prefix]), "bin_bytes": Path(prefix + ".bin").stat().st_size,
                "bin_sample_sha256": sampled_fingerprint(prefix + ".bin"),
                "documents": int(manifest["documents"]), "tokens": int(manifest["tokens"]),
                "tokenizer_hash": manifest.get("tokenizer_hash")}
    except (DataError, OSError, KeyError, TypeError, ValueError):  # the trainer reports it when it opens the data
        return None
