"""`megatron_ext.data.dataset_files`: our numpy reader of PREFIX.idx against Megatron-Core's `IndexedDataset` (the
oracle), its refusals, and the pre-launch check that no longer imports torch or Megatron-Core for it.

Before, `launch --check` (every sbatch script's preflight, the submitit launcher on the login node) opened the
index with Megatron-Core: 8.8 s wall, 8.1 s of CPU for recipes/tiny/cpt.yaml, 5 s of it importing megatron.core;
now 0.3 s."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data import DataError
from megatron_ext.data.dataset_files import (INDEX_DTYPES, check_complete, check_sft_masks, check_token_ids,
                                             index_fingerprint, read_index)

ROOT = Path(__file__).resolve().parents[2]


def megatron_dataset(prefix: Path, dtype, lengths: list[int], multimodal: bool = False) -> None:
    """A dataset written by Megatron-Core's own builder: one document per sequence, plus one document of
    three sequences (`add_document`), so that sequences and documents differ in number."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(len(lengths))
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype, multimodal=multimodal)
    for n in lengths:
        builder.add_item(torch.from_numpy(np.asarray(rng.integers(0, 100, n), dtype=dtype)), *([n % 2] if multimodal else []))
        builder.end_document()
    builder.add_document(np.asarray(rng.integers(0, 100, 9), dtype=dtype), [2, 3, 4],
                         *([[0, 1, 0]] if multimodal else []))
    builder.finalize(str(prefix) + ".idx")


@pytest.mark.parametrize("dtype", sorted(set(INDEX_DTYPES.values()), key=lambda t: np.dtype(t).name))
def test_equal_to_megatron_core_reader(tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "d"
    megatron_dataset(prefix, dtype, [5, 1, 17, 3])
    ours, theirs = check_complete(str(prefix)), IndexedDataset(str(prefix))
    assert ours.dtype == np.dtype(theirs.index.dtype) == np.dtype(dtype)
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        mine, oracle = getattr(ours, name), getattr(theirs.index, name)
        assert mine.dtype == oracle.dtype and np.array_equal(mine, oracle), name
    assert ours.sequence_lengths.tolist() == [5, 1, 17, 3, 2, 3, 4]
    assert ours.bin_bytes_needed() == (prefix.with_suffix(".bin")).stat().st_size


def test_multimodal_and_empty_indexes(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    megatron_dataset(tmp_path / "m", np.int32, [4, 6], multimodal=True)  # its modes follow the documents
    oracle = IndexedDataset(str(tmp_path / "m"), multimodal=True).index
    assert np.array_equal(read_index(tmp_path / "m.idx").sequence_lengths, oracle.sequence_lengths)

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    IndexedDatasetBuilder(str(tmp_path / "e.bin"), dtype=np.uint16).finalize(str(tmp_path / "e.idx"))
    empty = read_index(tmp_path / "e.idx")
    assert empty.sequence_lengths.size == 0 and empty.document_indices.tolist() == [0]
    assert empty.bin_bytes_needed() == 0


def mutated(src: Path, dst: Path, at: int, value: bytes = b"", keep: int | None = None, extra: bytes = b"") -> Path:
    data = bytearray(src.read_bytes())
    data[at:at + len(value)] = value
    dst.write_bytes(bytes(data[:keep]) + extra)
    return dst


def test_what_is_wrong_with_an_index_is_said(tmp_path):
    megatron_dataset(tmp_path / "d", np.uint16, [5, 1, 17, 3])
    good = tmp_path / "d.idx"
    n, d = 7, 6  # sequences; document indices 0 1 2 3 4 7
    cases = [
        (dict(at=0, value=b"XX"), r"bad header b'XXIDIDX\\x00\\x00', not a Megatron indexed dataset index"),
        (dict(at=9, value=(2).to_bytes(8, "little")), r"index version 2, this reader knows 1"),
        (dict(at=17, value=bytes([9])), r"unknown token dtype code 9"),
        (dict(at=18, value=(n + 1).to_bytes(8, "little")), rf"but its header's {n + 1} sequences and"),
        (dict(at=0, keep=good.stat().st_size - 1), rf"its header's {n} sequences and {d} document indices take "
                                                   rf"{34 + 12 * n + 8 * d}"),
        (dict(at=0, extra=b"\0" * 3), r"\d+ bytes, but its header's"),  # two files in one, say
        (dict(at=0, keep=33), r"33 bytes, shorter than the 34-byte header"),
    ]
    read_index(mutated(good, tmp_path / "same.idx", at=0))  # the control: the copy itself reads
    for i, (how, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            read_index(mutated(good, tmp_path / f"{i}.idx", **how))


def test_check_complete_and_sft_masks(tmp_path, sft_data):
    import shutil

    for suffix in (".bin", ".idx", ".json", "_lossmask.bin", "_lossmask.idx"):
        shutil.copy(sft_data + suffix, tmp_path / ("s" + suffix))
    prefix = str(tmp_path / "s")
    check_sft_masks(prefix)
    idx = tmp_path / "s_lossmask.idx"
    lengths = read_index(idx).sequence_lengths
    swapped = lengths.copy()
    k = int(np.flatnonzero(lengths != lengths[0])[0])  # two conversations of different lengths, exchanged
    swapped[[0, k]] = swapped[[k, 0]]
    data = bytearray(idx.read_bytes())
    data[34:34 + 4 * lengths.size] = swapped.astype(np.int32).tobytes()
    idx.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"data prefix .*/s: tokens and loss masks disagree in length"):
        check_sft_masks(prefix)
    (tmp_path / "s_lossmask.bin").unlink()
    with pytest.raises(DataError, match=r"/s_lossmask\.bin not found"):
        check_sft_masks(prefix)


def test_pre_launch_check_imports_neither_torch_nor_megatron(tmp_path, token_data):
    """The launcher's --check in a fresh interpreter: the recipe, the data (manifest, index, .bin size) and the
    checkpoint folder checked, and torch never imported. Control: the same process importing the trainer's data
    reader (what the check used before) has torch."""
    probe = ("import sys\n"
             "from megatron_ext.launch import main\n"
             "code = main(sys.argv[2:])\n"
             "if sys.argv[1] == 'reader':\n"
             "    import megatron_ext.data.loaders\n"
             "print('imported:', sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n"
             "sys.exit(code)\n")
    args = ["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", f"data.prefix={token_data}",
            f"checkpoint.dir={tmp_path / 'run'}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for mode, imported in (("check", "[]"), ("reader", "['torch']")):
        proc = subprocess.run([sys.executable, "-c", probe, mode, *args], capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"imported: {imported}" in proc.stdout and "ok: cpt" in proc.stdout, proc.stdout + proc.stderr


def test_pre_launch_check_names_a_python_without_the_trainer(monkeypatch, tmp_path, token_data, capsys):
    """Since the check no longer imports torch, a python without it (a login node's system python with only
    PyYAML) would pass the check, and every task would then die at its first import: it is looked for instead."""
    import importlib.util

    from megatron_ext import launch

    args = ["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", f"data.prefix={token_data}",
            f"checkpoint.dir={tmp_path / 'run'}"]
    monkeypatch.chdir(ROOT)
    assert launch.main(args) == 0  # the control: this python has both
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    capsys.readouterr()
    assert launch.main(args) == 1
    err = capsys.readouterr().err
    assert err == (f"error: python {sys.executable} cannot import torch, which the trainer needs; use the python of "
                   "the environment megatron_ext is installed in (sbatch: export PYTHON=/path/to/venv/bin/python)\n")


def test_a_bin_one_byte_short_is_refused(tmp_path):
    """check_complete: PREFIX.bin must reach the end of the index's last sequence (pointer + length x itemsize, hand
    computed here); one byte short is a truncated file, the exact size passes."""
    megatron_dataset(tmp_path / "d", np.int32, [5, 7])
    prefix, binary = str(tmp_path / "d"), tmp_path / "d.bin"
    index = check_complete(prefix)
    end = int(index.sequence_pointers[-1]) + 4 * int(index.sequence_lengths[-1])
    assert end == binary.stat().st_size == 4 * (5 + 7 + 9)
    os.truncate(binary, end - 1)
    with pytest.raises(DataError, match=rf"d\.bin is truncated or corrupt \({end - 1} bytes, its index points up to "
                                        rf"byte {end}\)"):
        check_complete(prefix)


def test_token_ids_must_have_embedding_rows():
    """Ids 0..vocab_size-1 have rows: the largest id equal to model.vocab_size is refused, one below passes; a
    manifest without max_token_id falls back to its tokenizer's size."""
    check_token_ids("p", {"max_token_id": 99, "vocab_size": 128}, 100)
    with pytest.raises(DataError, match=r"holds token ids up to 100 .*model.vocab_size = 100 has rows for ids "
                                        r"0..99 only.*at least 101"):
        check_token_ids("p", {"max_token_id": 100, "vocab_size": 128}, 100)
    check_token_ids("p", {"vocab_size": 100}, 100)
    with pytest.raises(DataError, match="was tokenized with ids up to 100"):
        check_token_ids("p", {"vocab_size": 101}, 100)


def test_index_fingerprint_is_the_idx_sha256_and_follows_the_order(tmp_path):
    """One prefix: the sha256 of its .idx (hashlib here, the oracle); several: over their sha256s in order, as a
    blend's caches follow the order of its prefixes (and their weights)."""
    import hashlib

    for name, lengths in (("a", [3]), ("b", [4, 5])):
        megatron_dataset(tmp_path / name, np.int32, lengths)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    digest = {p: hashlib.sha256(Path(p + ".idx").read_bytes()).hexdigest() for p in (a, b)}
    assert index_fingerprint([a]) == "sha256:" + digest[a]
    assert index_fingerprint([a, b]) == "sha256:" + hashlib.sha256(f"{digest[a]} {digest[b]}".encode()).hexdigest()
    assert index_fingerprint([a, b]) != index_fingerprint([b, a])
