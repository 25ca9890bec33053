"""Pins of data/dataset_files.py (mutation audit round 8): each test fails on one hand-made mutant of the
index, manifest or cache-file checks that the older tests let through."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data import DataError
from megatron_ext.data.dataset_files import (INDEX_MAGIC, check_complete, check_index_caches, index_cache_folder,
                                             index_fingerprint, npy_is_whole, read_index, read_manifest,
                                             sample_offsets, sampled_fingerprint)


def write_index(path: Path, lengths: list[int], itemsize: int = 4, code: int = 4) -> None:
    """A PREFIX.idx written by hand from the format in dataset_files' docstring (the oracle here): one document
    per sequence, sequences packed back to back from byte 0 of PREFIX.bin."""
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize if lengths else []
    with open(path, "wb") as f:
        f.write(struct.pack("<9sQBQQ", INDEX_MAGIC, 1, code, len(lengths), len(lengths) + 1))
        f.write(np.asarray(lengths, dtype=np.int32).tobytes())
        f.write(np.asarray(pointers, dtype=np.int64).tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())


def test_an_index_cut_right_after_its_header_is_said_to_be_short_of_its_arrays(tmp_path: Path):
    """An .idx copy cut at byte 34 holds the whole header: the error says what the header announces, not that the
    file is shorter than the header it holds (DF1: size <= header size)."""
    write_index(tmp_path / "d.idx", [5, 7])
    full = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(full[:34])
    with pytest.raises(ValueError) as e:
        read_index(tmp_path / "d.idx")
    # 34 (header) + 2 x (4 + 8) (lengths, pointers) + 3 x 8 (document indices) = 82
    assert str(e.value) == "34 bytes, but its header's 2 sequences and 3 document indices take 82"


def test_an_empty_bin_is_refused_even_when_its_index_has_no_sequences(tmp_path: Path):
    """PREFIX.bin of 0 bytes beside an index of no sequences: one 'truncated or corrupt (0 bytes)' error, not a
    pass that lets Megatron-Core's numpy.memmap fail on the empty file (DF9: the 0-byte check dropped)."""
    write_index(tmp_path / "d.idx", [])
    (tmp_path / "d.bin").write_bytes(b"")
    with pytest.raises(DataError) as e:
        check_complete(str(tmp_path / "d"))
    assert str(e.value) == (f"data prefix {tmp_path / 'd'}: {tmp_path / 'd'}.bin is truncated or corrupt (0 bytes); "
                            "prepare the data again (tools/prepare_data.py)")


def write_dataset(prefix: Path, manifest: dict) -> None:
    """PREFIX.bin/.idx (3 int32 tokens, one document) and PREFIX.json holding `manifest`."""
    write_index(Path(f"{prefix}.idx"), [3])
    Path(f"{prefix}.bin").write_bytes(np.arange(3, dtype=np.int32).tobytes())
    Path(f"{prefix}.json").write_text(json.dumps(manifest))


CPT_MANIFEST = {"kind": "cpt", "tokenizer_hash": "sha256:0", "vocab_size": 8, "documents": 1, "tokens": 3}


def test_a_dataset_named_like_a_loss_mask_with_its_own_manifest_reads(tmp_path: Path):
    """`notes_lossmask` with its own manifest, beside an SFT dataset `notes`, is a dataset of its own: it reads,
    it is not refused as the loss mask of `notes` (DF12: a manifest of its own no longer tells them apart)."""
    write_dataset(tmp_path / "notes", {**CPT_MANIFEST, "kind": "sft", "pad_id": 0})
    write_dataset(tmp_path / "notes_lossmask", CPT_MANIFEST)
    assert read_manifest(str(tmp_path / "notes_lossmask")) == CPT_MANIFEST


def test_a_lossmask_named_prefix_beside_a_cpt_dataset_is_just_missing_its_manifest(tmp_path: Path):
    """`notes_lossmask` without a manifest beside a *CPT* dataset `notes` is no SFT loss mask: the error is its
    missing manifest, not 'the loss mask of the SFT dataset notes' (DF13: the owner's kind not checked)."""
    write_dataset(tmp_path / "notes", CPT_MANIFEST)
    write_dataset(tmp_path / "notes_lossmask", CPT_MANIFEST)
    (tmp_path / "notes_lossmask.json").unlink()
    prefix = str(tmp_path / "notes_lossmask")
    with pytest.raises(DataError) as e:
        read_manifest(prefix)
    assert str(e.value) == f"data prefix {prefix}: {prefix}.json not found; run tools/prepare_data.py first"


@pytest.mark.parametrize("manifest, problem", [
    ({**CPT_MANIFEST, "documents": True}, "documents = True, not a whole number"),  # DF14: a bool is an int
    ({**CPT_MANIFEST, "kind": "sft"}, "no pad_id"),  # DF17: the SFT-only fields not checked
])
def test_manifest_fields_the_trainer_reads_are_checked(tmp_path: Path, manifest: dict, problem: str):
    """A manifest with `"documents": true`, or an SFT manifest without its pad_id, is one 'not a dataset manifest
    (...)' error naming the field, not a count of 1 or a KeyError in the loader later."""
    write_dataset(tmp_path / "d", manifest)
    prefix = str(tmp_path / "d")
    with pytest.raises(DataError) as e:
        read_manifest(prefix)
    assert str(e.value) == (f"data prefix {prefix}: {prefix}.json is not a dataset manifest ({problem}); prepare the "
                            "data again (tools/prepare_data.py)")


def test_zero_is_a_valid_pad_id_and_max_token_id(tmp_path: Path):
    """Whole numbers include 0: a tokenizer whose pad token is id 0, and a corpus whose largest id is 0, read
    (DF15: only positive numbers accepted)."""
    manifest = {**CPT_MANIFEST, "kind": "sft", "pad_id": 0, "max_token_id": 0}
    write_dataset(tmp_path / "d", manifest)
    assert read_manifest(str(tmp_path / "d"), "sft") == manifest


def test_an_index_rewritten_in_place_with_the_same_size_is_hashed_again(tmp_path: Path):
    """The per-process digest cache is keyed by the file's mtime too: an .idx overwritten in place (same inode,
    same size, other lengths) gets its new sha256, not the old one (DF20: mtime left out of the key)."""
    write_index(tmp_path / "d.idx", [3, 5])
    before = index_fingerprint([str(tmp_path / "d")])
    with open(tmp_path / "d.idx", "r+b") as f:  # same inode: a copy over the file, not a rename
        f.seek(34)
        f.write(np.asarray([5, 3], dtype=np.int32).tobytes())
    stat = os.stat(tmp_path / "d.idx")
    os.utime(tmp_path / "d.idx", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock: 1 s later
    after = index_fingerprint([str(tmp_path / "d")])
    assert after == "sha256:" + hashlib.sha256((tmp_path / "d.idx").read_bytes()).hexdigest() != before


def test_index_caches_go_beside_the_first_prefix(tmp_path: Path):
    """Without data.cache_dir, a blend's caches go to cache/ beside its *first* prefix, the folder the builder,
    the setup check and `launch --check` agree on (DF21: the last prefix's folder)."""
    first, last = str(tmp_path / "a" / "cpt"), str(tmp_path / "b" / "cpt")
    assert index_cache_folder([first, last], None) == str(tmp_path / "a" / "cache")
    assert index_cache_folder([first, last], "/elsewhere") == "/elsewhere"


def test_cache_vetting_passes_what_megatron_core_reads_as_arrays(tmp_path: Path):
    """What check_index_caches lets through: a cache 'folder' that is a file (Megatron-Core's own error when it
    saves; DF22: NotADirectoryError escaped), an empty .npy (DF23: refused as not a .npy) and a format 2.0 .npy
    (numpy reads it as an array; DF25: refused as a format Megatron-Core does not write)."""
    (tmp_path / "a_file").write_text("x")
    check_index_caches([str(tmp_path / "a_file")])
    caches = tmp_path / "cache"
    caches.mkdir()
    (caches / "empty.npy").write_bytes(b"")
    with open(caches / "v2.npy", "wb") as f:
        np.lib.format.write_array(f, np.arange(4, dtype=np.int32), version=(2, 0))
    check_index_caches([str(caches)])


def test_an_npy_of_python_objects_is_refused(tmp_path: Path):
    """A .npy of dtype object is a pickle inside a .npy header: refused by name before Megatron-Core's
    numpy.load(allow_pickle=True) runs it (DF24: the object check dropped)."""
    caches = tmp_path / "cache"
    caches.mkdir()
    np.save(caches / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=r"objects\.npy: holds Python objects \(pickled data\)"):
        check_index_caches([str(caches)])


def test_npy_is_whole_at_exactly_its_data_size(tmp_path: Path):
    """A complete .npy (header + every byte of its data) is whole, one byte short is not: a whole cache is reused,
    not rebuilt at every start (DF26: > for >=)."""
    path = tmp_path / "c.npy"
    np.save(path, np.arange(10, dtype=np.int64))
    assert npy_is_whole(str(path))
    os.truncate(path, path.stat().st_size - 1)
    assert not npy_is_whole(str(path))


def test_sampled_blocks_span_the_file_and_the_hash_covers_the_size(tmp_path: Path):
    """Above blocks x block_bytes the sampled offsets run from 0 to the last block, which ends at the file's end
    (DF28: spaced by /blocks, the tail unsampled); the fingerprint is sha256(size as 8 bytes LE + the blocks),
    hand computed (DF29: the size left out)."""
    assert sample_offsets(100, blocks=4, block_bytes=10) == [0, 30, 60, 90]
    data = bytes(range(256)) * 4
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    offsets = sample_offsets(len(data), blocks=4, block_bytes=16)
    assert offsets[0] == 0 and offsets[-1] == len(data) - 16
    oracle = hashlib.sha256(len(data).to_bytes(8, "little") + b"".join(data[o:o + 16] for o in offsets))
    assert sampled_fingerprint(path, blocks=4, block_bytes=16) == "sha256:" + oracle.hexdigest()


def test_a_cpt_dataset_given_where_sft_is_expected_is_refused(tmp_path: Path):
    """An SFT run's data.prefix naming a CPT dataset: one error naming both kinds and the command that prepares the
    right one (DF33: only an SFT dataset where CPT is expected refused)."""
    write_dataset(tmp_path / "d", CPT_MANIFEST)
    prefix = str(tmp_path / "d")
    with pytest.raises(DataError) as e:
        read_manifest(prefix, "sft")
    assert str(e.value) == (f"data prefix {prefix}: a 'cpt' dataset, expected 'sft'; prepare it with "
                            "`prepare_data.py sft`")
