"""`tools/checkpoint.py info DIR --verify`: every stored byte of an iteration read and each item's CRC-32 checked.

A flipped byte inside a tensor keeps the archive's structure: torch's reader does not check the CRC, so the load
succeeds with a wrong weight (shown below, the oracle of why --verify exists). The damage is made by hand at a known
offset of the torch_dist index; the check is zipfile's CRC-32 over the stored archive."""

from __future__ import annotations

import io
import struct
import zipfile

from megatron_ext.checkpoint import load_checkpoint
from megatron_ext.checkpoint_damage import verify_contents
from megatron_ext.checkpoint_index import read_dcp_index
from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY
from tests.unit.test_checkpoint_cli import _info, ckpt  # noqa: F401  (the fixture: a real step-2 checkpoint)


def _flip_data_byte(file, offset: int = 0, length: int | None = None) -> None:
    """Invert the middle byte of the largest member's data in the torch archive at [offset, offset + length) of
    `file` (a whole file by default): inside the CRC-checked bytes, not a header or the alignment padding."""
    blob = file.read_bytes()[offset:None if length is None else offset + length]
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        member = max(archive.infolist(), key=lambda m: m.compress_size)
    name_len, extra_len = struct.unpack("<HH", blob[member.header_offset + 26:member.header_offset + 30])
    at = offset + member.header_offset + 30 + name_len + extra_len + member.compress_size // 2
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _flip_byte_in(path, item: str) -> tuple[str, int]:
    """Invert a data byte of the stored item whose key starts with `item`; (its file, the item's offset)."""
    index = read_dcp_index(path)
    info = next(i for m, i in index.storage_data.items() if m.fqn.startswith(item))
    _flip_data_byte(path / info.relative_path, info.offset, info.length)
    return info.relative_path, info.offset


def test_verify_passes_a_sound_checkpoint(ckpt, capsys):  # noqa: F811
    code, out, err = _info(capsys, ckpt, "--verify")
    assert code == 0 and "contents read, every stored item's CRC-32 checked)" in out, out + err
    # the bar's total is the stored bytes, zip headers included: it ends full (it ended near 96%, the member data only)
    last = [line for line in err.splitlines() if line.startswith("verify")][-1]
    assert "100%" in last, err
    index = read_dcp_index(ckpt / "iter_0000002")
    assert verify_contents(ckpt / "iter_0000002", index, progress=False) == []


def test_a_flipped_byte_loads_silently_and_verify_names_it(ckpt, capsys):  # noqa: F811
    path = ckpt / "iter_0000002"
    before, after = (build_model(TINY, BuildOptions(device="cpu", seq_length=32)) for _ in range(2))
    load_checkpoint(ckpt, [before], weights_only=True)
    name, offset = _flip_byte_in(path, "embedding.word_embeddings.weight")
    # why --verify exists: torch loads the damaged shard without a word, with one embedding value changed
    load_checkpoint(ckpt, [after], weights_only=True)
    changed = before.embedding.word_embeddings.weight != after.embedding.word_embeddings.weight
    assert changed.sum().item() == 1
    code, out, err = _info(capsys, ckpt)  # sizes only: complete
    assert code == 0 and "iter_0000002: complete" in out
    code, out, err = _info(capsys, ckpt, "--verify")
    assert code == 1, out + err
    assert f"iter_0000002: DAMAGED: {name}: 1 of the " in out and f"damaged; the first, bytes {offset:,}-" in out
    assert "archive/data/0 fails its CRC-32 check" in out
    assert err.splitlines()[0].startswith("verify: ")  # the progress lines (no terminal) come before
    assert err.splitlines()[-1] == (f"error: {ckpt}: iteration 2 is damaged (above); copy the checkpoint again or "
                                    "use an earlier iteration")


def test_verify_checks_common_pt_and_every_file(ckpt):  # noqa: F811
    path = ckpt / "iter_0000002"
    files = sorted({i.relative_path for i in read_dcp_index(path).storage_data.values()})
    assert len(files) >= 2
    for name in files:  # one damaged item in each file: each is named, not only the first
        index = read_dcp_index(path)
        _flip_byte_in(path, next(m.fqn for m, i in index.storage_data.items() if i.relative_path == name))
    _flip_data_byte(path / "common.pt")
    found = verify_contents(path, read_dcp_index(path), progress=False)
    assert [name for name, _ in found] == files + ["common.pt"], found


def test_zeroed_shard_still_named_at_load(ckpt):  # noqa: F811
    """The refactor kept the load-failure path: a zeroed shard is named with 'File is not a zip file'."""
    from megatron_ext.checkpoint_damage import damaged_shard
    from tests.unit.test_checkpoint import zero_after

    path = ckpt / "iter_0000002"
    shard = sorted(path.glob("*.distcp"))[-1]
    zero_after(shard)
    name, what = damaged_shard(path, read_dcp_index(path))
    assert name == shard.name and what.endswith("File is not a zip file"), what
