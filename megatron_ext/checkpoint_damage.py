"""Which shard of a checkpoint is damaged, when its size is right but its bytes are not (a bad copy, a disk fault).

torch.distributed.checkpoint stores each tensor (and each object) as a `torch.save` zip archive at an offset of a
`.distcp` file. A damaged one fails deep in torch ('Weights only load failed ... Unsupported operand 0',
'PytorchStreamReader failed reading zip archive'), wrapped in a CheckpointException that names no file; the size
check (`check_complete`) passes. After such a failure the stored items the load asked for are checked as zip
archives (their structure and every member's CRC-32; nothing is unpickled), file by file, until a damaged file is
found: no more reading than the failed load did.

A damaged byte inside a tensor leaves the archive sound and the load succeeds: torch's zip reader does not check the
CRC-32 (a flipped byte in an embedding loaded without a word, tested). `verify_contents` checks every item, and
`common.pt`, reading the whole iteration once (`tools/checkpoint.py info DIR --verify`).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from megatron_ext.checkpoint_index import CheckpointError

FIX = "copy the checkpoint again or use an earlier iteration"


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own (an item need not fit in
    memory: an optimizer bucket can be gigabytes)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def read(self, size: int = -1) -> bytes:
        # RawIOBase's read goes through readinto: two more copies of every chunk (verify ran at a third of the rate
        # of a plain read + CRC-32; bench/checkpoint_verify_bench.py)
        n = self.length - self.pos if size is None or size < 0 else max(0, min(size, self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


_CHUNK = 16 << 20  # bytes read at a time from an archive member: the progress bar moves within a large tensor


def _archive_problem(f, offset: int, length: int, advance=None) -> str | None:
    """What is wrong with the torch archive at [offset, offset + length) of `f` (its structure, every member's
    CRC-32), or None when it is sound. `advance(n)`, when given, is told of every n bytes of data read."""
    try:
        with zipfile.ZipFile(_Window(f, offset, length)) as archive:
            for member in archive.infolist():
                try:  # zipfile checks the CRC-32 as the member's last bytes are read
                    with archive.open(member) as data:
                        while chunk := data.read(_CHUNK):
                            if advance is not None:
                                advance(len(chunk))
                except zipfile.BadZipFile as e:
                    return (f"{member.filename} fails its CRC-32 check" if str(e).startswith("Bad CRC-32")
                            else f"{member.filename}: {e}")
    except (zipfile.BadZipFile, EOFError, ValueError, KeyError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}" if not isinstance(e, zipfile.BadZipFile) else str(e)
    return None


def _checked(f, offset: int, length: int, bar) -> str | None:
    """`_archive_problem` of an item that moves the progress `bar` by the item's whole `length`: the member data as it
    is read, then the rest (zip headers and padding, a damaged item's unread bytes), so that a bar whose total is the
    stored bytes ends at 100% (it ended near 96% on a sound checkpoint)."""
    read = 0

    def advance(n: int) -> None:
        nonlocal read
        read += n
        bar.update(n)

    problem = _archive_problem(f, offset, length, advance)
    bar.update(max(0, length - read))
    return problem


def _key(fqn: str) -> str:
    return fqn.split("/shard_")[0]  # an object's shards are stored as KEY/shard_I_N


def _items_by_file(index) -> dict[str, list]:
    """{`.distcp` file name: [(item key, storage info)] in file order} of a torch_dist index (compressed items, no
    plain archives, left out)."""
    files: dict[str, list] = {}
    for meta_index, info in index.storage_data.items():
        if not getattr(info, "transform_descriptors", None):
            files.setdefault(info.relative_path, []).append((_key(meta_index.fqn), info))
    return {name: sorted(items, key=lambda item: item[1].offset) for name, items in files.items()}


def _how_damaged(bad: list, n: int) -> str:
    """The words for a file with `bad` [(storage info, problem)] among its `n` items."""
    (first, problem) = bad[0]
    how_many = f"all {n} items stored in it are" if len(bad) == n else f"{len(bad)} of the {n} items in it are"
    return f"{how_many} damaged; the first, bytes {first.offset:,}-{first.offset + first.length:,}: {problem}"


def damaged_shard(path: str | Path, index, keys: set[str] | None = None) -> tuple[str, str] | None:
    """(file name, what is damaged) for the first `.distcp` file of the checkpoint folder `path` that holds a stored
    item (of `keys` only, when given) that is not a sound torch archive; None when every such item is sound.
    `index`: its torch_dist index (`read_dcp_index`)."""
    path = Path(path)
    files = _items_by_file(index)
    for name in sorted(files):
        items = files[name]
        if keys is not None and not any(key in keys for key, _ in items):
            continue
        try:
            with open(path / name, "rb") as f:
                bad = [(info, problem) for key, info in items
                       if (keys is None or key in keys) and (problem := _archive_problem(f, info.offset, info.length))]
                if bad:  # how much of the file is damaged: all of its items
                    bad = [(info, problem) for _, info in items
                           if (problem := _archive_problem(f, info.offset, info.length))]
        except OSError as e:
            return name, f"it cannot be read ({e.strerror or e})"
        if bad:
            return name, _how_damaged(bad, len(items))
    return None


def verify_contents(path: str | Path, index, progress: bool = True) -> list[tuple[str, str]]:
    """[(file name, what is damaged)] for every file of the checkpoint folder `path` with an item that is not a
    sound torch archive (its structure, every member's CRC-32): the `.distcp` files of `index` (its torch_dist
    index) and `common.pt`; [] when all are sound. Reads every stored byte once, with a progress bar (stderr)."""
    from megatron_ext.progress import progress_bar

    path = Path(path)
    files = _items_by_file(index)
    common = path / "common.pt"
    total = sum(info.length for items in files.values() for _, info in items)
    total += common.stat().st_size if common.is_file() else 0
    found = []
    with progress_bar(total=total, desc="verify", unit="B", unit_scale=True, enabled=progress) as bar:
        for name in sorted(files):
            try:
                with open(path / name, "rb") as f:
                    bad = [(info, problem) for _, info in files[name]
                           if (problem := _checked(f, info.offset, info.length, bar))]
            except OSError as e:
                found.append((name, f"it cannot be read ({e.strerror or e})"))
                continue
            if bad:
                found.append((name, _how_damaged(bad, len(files[name]))))
        if common.is_file():
            try:
                with open(common, "rb") as f:
                    problem = _checked(f, 0, common.stat().st_size, bar)
            except OSError as e:
                problem = f"it cannot be read ({e.strerror or e})"
            if problem:
                found.append((common.name, problem))
    return found


def failed_reads(failure: BaseException) -> dict[int, Exception] | None:
    """The per-rank errors of torch's CheckpointException `failure` (rank -> exception), or None when one of them is
    an interrupt (Ctrl-C, SIGTERM: `interrupts_unwrapped` raises that) or there are none."""
    failures = getattr(failure, "failures", None) or {}
    errors = {rank: f[0] if isinstance(f, tuple) else f for rank, f in failures.items()}
    return errors if errors and all(isinstance(e, Exception) for e in errors.values()) else None


def damaged_shard_error(path: str | Path, index, keys: set[str] | None = None) -> CheckpointError | None:
    """The one-line CheckpointError for a load of `path` that failed in torch, when `damaged_shard` finds the damaged
    file; None when it finds none (the failure was something else)."""
    found = damaged_shard(path, index, keys)
    if found is None:
        return None
    name, what = found
    return CheckpointError(f"{Path(path) / name}: cannot read its tensors (corrupt shard: {what}); {FIX}")


def read_failure_error(failure: BaseException, path: Path, state: dict, index) -> CheckpointError | None:
    """The CheckpointError to raise for a load of `state` from `path` that torch failed to read (its
    CheckpointException `failure`, which every rank raises with every rank's failures): on a rank that finds a damaged
    shard among the items it asked for, that file (a rank's own finding, not marked alike); on a rank whose read went
    well, which ranks failed. None for an interrupt or a failure that no damage explains: raise it as it was."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if (failures := failed_reads(failure)) is None:
        return None
    keys = {v.key for v in nested_values(state) if isinstance(getattr(v, "key", None), str)}
    if (error := damaged_shard_error(path, index, keys)) is not None:
        return error
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank not in failures:
        return CheckpointError(f"{path}: the load failed on rank(s) {', '.join(map(str, sorted(failures)))}, not on "
                               "this one (their error lines say why)")
    return None
