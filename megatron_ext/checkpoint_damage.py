"""Which shard of a checkpoint is damaged, when its size is right but its bytes are not (a bad copy, a disk fault).

torch.distributed.checkpoint stores each tensor (and each object) as a `torch.save` zip archive at an offset of a
`.distcp` file. A damaged one fails deep in torch ('Weights only load failed ... Unsupported operand 0',
'PytorchStreamReader failed reading zip archive'), wrapped in a CheckpointException that names no file; the size
check (`check_complete`) passes. After such a failure the stored items the load asked for are checked as zip
archives (their structure and every member's CRC-32; nothing is unpickled), file by file, until a damaged file is
found: no more reading than the failed load did.
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

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _archive_problem(f, offset: int, length: int) -> str | None:
    """What is wrong with the torch archive at [offset, offset + length) of `f`, or None when it is sound."""
    try:
        with zipfile.ZipFile(_Window(f, offset, length)) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, KeyError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}" if not isinstance(e, zipfile.BadZipFile) else str(e)
    return None if bad is None else f"{bad} fails its CRC-32 check"


def _key(fqn: str) -> str:
    return fqn.split("/shard_")[0]  # an object's shards are stored as KEY/shard_I_N


def damaged_shard(path: str | Path, index, keys: set[str] | None = None) -> tuple[str, str] | None:
    """(file name, what is damaged) for the first `.distcp` file of the checkpoint folder `path` that holds a stored
    item (of `keys` only, when given) that is not a sound torch archive; None when every such item is sound.
    `index`: its torch_dist index (`read_dcp_index`)."""
    path = Path(path)
    files: dict[str, list] = {}
    for meta_index, info in index.storage_data.items():
        if not getattr(info, "transform_descriptors", None):  # a compressed item is no plain archive
            files.setdefault(info.relative_path, []).append((_key(meta_index.fqn), info))
    for name in sorted(files):
        items = sorted(files[name], key=lambda item: item[1].offset)
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
            (first, problem), n = bad[0], len(items)
            how_many = f"all {n} items stored in it are" if len(bad) == n else f"{len(bad)} of the {n} items in it are"
            return name, (f"{how_many} damaged; the first, bytes {first.offset:,}-{first.offset + first.length:,}: "
                          f"{problem}")
    return None


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
