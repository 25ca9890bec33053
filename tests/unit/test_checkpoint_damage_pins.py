"""megatron_ext.checkpoint_damage pinned where the mutation audit (round 6) found it untested: which file and item a
damaged checkpoint is blamed on, for the keys a rank asked for; the byte window each stored item is read through;
the archive damage zipfile reports as other than BadZipFile; the rank lines of a load that failed elsewhere.

The damage is made by hand at offsets of the real torch_dist index of a step-2 checkpoint (`ckpt`); the oracles are
that index, zipfile's own view of an archive, and io.BytesIO over the same bytes."""

from __future__ import annotations

import io
import struct
import traceback
import zipfile

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.checkpoint_damage import (_archive_problem, _Window, damaged_shard, failed_reads, read_failure_error,
                                            verify_contents)
from megatron_ext.checkpoint_index import read_dcp_index
from tests.unit.test_checkpoint_cli import ckpt  # noqa: F401  (the fixture: a real step-2 checkpoint)
from tests.unit.test_checkpoint_verify import _flip_byte_in


def _item(path, prefix: str):
    """(key, storage info) of the first stored item whose key starts with `prefix`."""
    return next((m.fqn, i) for m, i in read_dcp_index(path).storage_data.items() if m.fqn.startswith(prefix))


def test_only_the_asked_items_decide_and_the_whole_file_is_counted(ckpt):  # noqa: F811
    """A rank blames a file only for damage in items it asked for; then the words count every damaged item of that
    file and give the first one's byte range (its offset and end, from the index)."""
    path = ckpt / "iter_0000002"
    numel_key, numel = _item(path, "optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_")
    _, out_layer = _item(path, "output_layer.weight")
    assert out_layer.relative_path == numel.relative_path and numel.offset < out_layer.offset  # both in one file
    n = sum(i.relative_path == numel.relative_path for i in read_dcp_index(path).storage_data.values())
    _flip_byte_in(path, numel_key)
    # damage in an item this rank did not ask for is not the cause of its failure
    assert damaged_shard(path, read_dcp_index(path), {"output_layer.weight"}) is None
    _flip_byte_in(path, "output_layer.weight")
    name, what = damaged_shard(path, read_dcp_index(path), {"output_layer.weight"})
    assert name == out_layer.relative_path
    assert what == (f"2 of the {n} items in it are damaged; the first, bytes {numel.offset:,}-"
                    f"{numel.offset + numel.length:,}: archive/data.pkl fails its CRC-32 check"), what


def test_an_objects_shards_are_asked_for_by_its_key(ckpt):  # noqa: F811
    """A ShardedObject is stored as KEY/shard_I_N; a load asks for KEY: its damage is found."""
    path = ckpt / "iter_0000002"
    fqn, info = _item(path, "optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_")
    _flip_byte_in(path, fqn)
    found = damaged_shard(path, read_dcp_index(path), {fqn.split("/shard_")[0]})
    assert found is not None and found[0] == info.relative_path, found


def test_files_the_rank_did_not_ask_for_are_not_opened_and_the_first_file_is_named(ckpt):  # noqa: F811
    """A missing file that holds none of the asked items is not this load's failure; with damage in two files, the
    first by name is the one named (the same on every rank)."""
    path = ckpt / "iter_0000002"
    files = sorted({i.relative_path for i in read_dcp_index(path).storage_data.values()})
    assert files == ["__0_0.distcp", "__0_1.distcp"]
    index = read_dcp_index(path)
    _flip_byte_in(path, "embedding.word_embeddings.weight")  # in __0_0
    _flip_byte_in(path, "output_layer.weight")  # in __0_1
    assert damaged_shard(path, index)[0] == "__0_0.distcp"
    (path / "__0_0.distcp").unlink()
    assert damaged_shard(path, index, {"output_layer.weight"})[0] == "__0_1.distcp"
    # a sound item of __0_1 only (that file's damage is in another item)
    assert damaged_shard(path, index, {"optimizer.distributed.dp_group_idx_0.per_bucket_numel"}) is None


def test_verify_goes_on_past_an_unreadable_file(ckpt):  # noqa: F811
    path = ckpt / "iter_0000002"
    index = read_dcp_index(path)
    _flip_byte_in(path, "output_layer.weight")
    (path / "__0_0.distcp").unlink()
    found = verify_contents(path, index, progress=False)
    assert [name for name, _ in found] == ["__0_0.distcp", "__0_1.distcp"], found
    assert found[0][1] == "it cannot be read (No such file or directory)"
    assert found[1][1].startswith("1 of the ")


def test_an_unknown_compression_method_is_a_finding_not_a_crash(ckpt):  # noqa: F811
    """A damaged header byte that names a compression method zipfile lacks raises NotImplementedError in zipfile
    (not BadZipFile): reported as the damage of common.pt, not raised out of `--verify`."""
    path = ckpt / "iter_0000002"
    common = path / "common.pt"
    blob = bytearray(common.read_bytes())
    central = blob.index(b"PK\x01\x02")  # the first central-directory entry: its method field is at +10
    blob[central + 10:central + 12] = struct.pack("<H", 99)
    common.write_bytes(bytes(blob))
    found = verify_contents(path, read_dcp_index(path), progress=False)
    assert found == [("common.pt", "NotImplementedError: That compression method is not supported")], found


def test_the_window_reads_as_a_file_of_those_bytes_only(tmp_path):
    """_Window(f, offset, length) answers as io.BytesIO over bytes [offset, offset + length) does (the oracle):
    nothing past its end, nothing before its start; over a file that ends inside it (a truncated copy) the data
    ends early and the position follows the bytes that came, as a file's does."""
    data = bytes(range(256)) * 4
    file = tmp_path / "f"
    file.write_bytes(data)
    with open(file, "rb") as f:
        window, oracle = _Window(f, 100, 300), io.BytesIO(data[100:400])
        for whence, pos, size in ((io.SEEK_SET, 0, 50), (io.SEEK_CUR, 10, 1000), (io.SEEK_END, -30, 100),
                                  (io.SEEK_END, -5000, 20), (io.SEEK_SET, 250, -1), (io.SEEK_CUR, -7, 3)):
            assert window.seek(pos, whence) == oracle.seek(pos, whence)
            assert window.read(size) == oracle.read(size), (whence, pos, size)
            assert window.tell() == oracle.tell()
        short = _Window(f, 900, 300)  # the file has 124 of its bytes
        assert short.read(80) == data[900:980] and short.read(1000) == data[980:] and short.tell() == 124


def test_the_progress_is_told_of_every_data_byte(tmp_path):
    """`advance` adds up to the members' data, as zipfile lists them (the bar moves by what was read)."""
    file = tmp_path / "t.pt"
    torch.save({"a": torch.arange(1000.0), "b": torch.ones(7)}, file)
    with zipfile.ZipFile(file) as archive:
        data_bytes = sum(m.file_size for m in archive.infolist())
    seen = []
    with open(file, "rb") as f:
        assert _archive_problem(f, 0, file.stat().st_size, seen.append) is None
    assert sum(seen) == data_bytes


def _failure(**errors) -> CheckpointException:
    return CheckpointException("load failed", {int(r[1:]): (e, traceback.StackSummary()) for r, e in errors.items()})


def test_an_interrupt_on_any_rank_is_raised_as_it_was():
    assert failed_reads(_failure(r0=ValueError("x"), r1=KeyboardInterrupt())) is None
    assert set(failed_reads(_failure(r0=ValueError("x"), r1=OSError("y")))) == {0, 1}


def test_a_rank_whose_read_went_well_names_the_ranks_that_failed(ckpt):  # noqa: F811
    """Rank 0 (no process group) with a sound checkpoint: another rank's failure is named, in rank order; its own
    failure is raised as it was (None)."""
    path = ckpt / "iter_0000002"
    index = read_dcp_index(path)
    error = read_failure_error(_failure(r3=ValueError("x"), r1=ValueError("y")), path, {}, index)
    assert str(error) == f"{path}: the load failed on rank(s) 1, 3, not on this one (their error lines say why)"
    assert read_failure_error(_failure(r0=ValueError("x")), path, {}, index) is None


def test_sound_files_are_not_blamed(ckpt):  # noqa: F811
    """The control of the tests above: the untouched checkpoint has no finding, with or without keys."""
    path = ckpt / "iter_0000002"
    index = read_dcp_index(path)
    assert damaged_shard(path, index) is None and damaged_shard(path, index, {"output_layer.weight"}) is None


def test_a_compressed_item_is_not_read_as_an_archive(ckpt):  # noqa: F811
    """torch records a stored item written through a stream transform (its zstd extension) with
    `transform_descriptors`: its bytes are a compressed stream, no zip archive, so they are not checked as one (else
    every such item of a sound checkpoint would read as damaged). The item's bytes are made a zstd frame's magic and
    noise, and its index entry marked as torch marks one; control: unmarked, the same bytes are named."""
    import dataclasses

    path = ckpt / "iter_0000002"
    index = read_dcp_index(path)
    meta, info = next((m, i) for m, i in index.storage_data.items() if m.fqn == "output_layer.weight")
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x28\xb5\x2f\xfd" + bytes(range(7, 250)) * (info.length // 243 - 1))
    assert [name for name, _ in verify_contents(path, index, progress=False)] == [info.relative_path]
    index.storage_data[meta] = dataclasses.replace(info, transform_descriptors=["zstd"])
    assert verify_contents(path, index, progress=False) == []
    assert damaged_shard(path, index, {"output_layer.weight"}) is None
