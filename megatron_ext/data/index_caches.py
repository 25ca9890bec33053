"""Megatron-Core's dataset builder, whose index caches are written whole or not at all, a failed write kept for the
trainer to tell every rank.

On a cache miss, rank 0's GPTDataset and BlendedDataset write their caches (FOLDER/<md5>-<class>-<split>-*.npy and a
description .txt) straight to their final names. A full disk, a quota, a file-size limit or a kill left a cut .npy
there; once every name of a build is present Megatron-Core takes it for a cache hit, and every later start failed in
numpy.load ('mmap length is greater than file size'). And the failure surfaced as Megatron-Core's 'Failed to write
dataset materials' traceback on rank 0, while the other ranks waited for rank 0 in the builder's barrier (gloo:
'Connection closed by peer' tracebacks; NCCL: until the process-group timeout).

Through Megatron-Core's extension points, nothing patched: `DatasetBuilder` is its BlendedMegatronDatasetBuilder
building `GPTDataset` (the `cls` it takes) and, in `build_generic_dataset`, the method through which it constructs
every dataset, `BlendedDataset` in place of its own. Both are subclasses keeping Megatron-Core's class names, which
name the cache files and enter their hashes: the caches are the same files, byte for byte. On a miss, on the rank
that writes, each builds its indices with Megatron-Core's own code into a private staging folder inside the cache
folder (`.staging-<host>-<pid namespace>-<pid>-<random>`, a name no cache lookup matches; the same file system),
then moves the files into place with os.replace, the description last: Megatron-Core counts a cache present only
when all its names exist, so a move cut short leaves a miss, never a cut file. A write that fails (OSError) removes
the staging folder and is kept on the builder's `writes` (`CacheWrites`), not raised: rank 0 leaving the builder
early left the others in its barrier. The dataset then holds placeholder indices of its expected length, so that
the builder finishes, and writes nothing more; the caller raises `writes.said()` on every rank
(`loaders.build_cpt_datasets`).

A kill (SIGKILL, a node lost, a Slurm time limit) leaves its staging folder behind (no cache name, nothing reads
it), as large as the caches written so far (GBs at 100B tokens), one more for every requeued job killed while it
built. The rank that writes removes such folders at each build, a hit or a miss, once per cache folder
(`remove_dead_staging`), in one `[data]` line naming them and their size: those of its own host and PID namespace
whose process is gone, and any not touched for `STALE_AFTER_S` (7 days). Several jobs, on several hosts, may build
in one shared cache folder at once: a live build's folder is never removed. Another host's process (or another
container's) cannot be asked, hence the age for those (a requeued job often runs on another node); a recycled pid
only keeps a dead build's folder until that process ends too, or for the 7 days.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from typing import Any, Callable, TypeVar

import numpy
import torch
from megatron.core.datasets import blended_dataset, gpt_dataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

from megatron_ext.data.dataset_files import npy_is_whole
from megatron_ext.disk_space import SPACE_ERRNOS, no_space_message, probe_write, size_text, space_errno
from megatron_ext.log_lines import log_line

T = TypeVar("T")

STAGING_PREFIX = ".staging-"
# A build touches its staging folder every few minutes at most (a file made, or written to: the longest step, the
# sample index of 100B tokens, takes minutes), so a week without outlasts any live build, one suspended by Slurm's
# preemption included, and the clock skew between the hosts of a shared file system (seconds).
STALE_AFTER_S = 7 * 24 * 3600
# .staging-<host>-<pid namespace>-<pid>-<random>: the last three fields hold no '-', so any host name parses. An
# older version's .staging-<pid>-<random> names no host: only its age removes it.
_STAGING_NAME = re.compile(re.escape(STAGING_PREFIX) + r"(?:(?P<space>.+)-)?(?P<pid>\d+)-[0-9a-f]{8}")


class CacheWrites:
    """The index-cache writes of one build: `failure`, the first that failed, as (cache folder, file name, OSError),
    the error judged for want of room (a test write where the write went, when numpy hid its errno)."""

    def __init__(self) -> None:
        self.failure: tuple[str, str, OSError] | None = None
        self._swept: set[str] = set()
        self._lock = threading.Lock()  # Megatron-Core builds several prefixes in threads

    def first_visit(self, folder: str) -> bool:
        """True the first time this build asks for `folder` (its dead builds' staging folders removed then)."""
        with self._lock:
            first = folder not in self._swept
            self._swept.add(folder)
            return first

    def keep(self, folder: str, name: str, error: OSError) -> None:
        """Keep `error`, writing `name` into `folder`, unless an earlier failure is kept."""
        with self._lock:
            self.failure = self.failure or (folder, name, error)

    def said(self) -> str | None:
        """One line for `failure` (the cache folder, the space left there, the file, the fix), or None."""
        if self.failure is None:
            return None
        folder, name, error = self.failure
        return (no_space_message(error, f"data cache folder {folder}", folder,
                                 f"writing the index cache {name} failed and left nothing there; the datasets were "
                                 "not built", "free space there or set data.cache_dir to a folder with room")
                or f"data cache folder {folder}: cannot write {name} ({error.strerror or error}); the datasets were "
                   "not built; set data.cache_dir to a folder this job can write")


def _staged(folder: str, names: list[str], writes: CacheWrites | None, build: Callable[[str], T]) -> T:
    """`build(staging)`, which writes `names` (in that order) into the staging folder, then the files moved into
    `folder`, the first name (the description) last. An OSError: the staging folder removed, then raised when there
    is no `writes`, else kept there and raised as `_Kept`."""
    staging = os.path.join(folder, f"{STAGING_PREFIX}{_pid_space()}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        try:
            os.makedirs(staging)
            result = build(staging)
            for name in names[1:] + names[:1]:
                os.replace(os.path.join(staging, name), os.path.join(folder, name))
            return result
        except OSError as e:
            error, name = _judged(e, staging), _failed_name(e, staging, names)
            if writes is None:
                raise
            writes.keep(folder, name, error)
            raise _Kept from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # its space back; nothing in `folder` names it


def _pid_space() -> str:
    """This process's host name and PID namespace: where the pid in a staging folder's name is one `os.kill` asks
    about (a container may share its host's name but not its process table)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux
        namespace = 0
    return f"{socket.gethostname().replace(os.sep, '_')}-{namespace}"


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's too); what cannot be asked counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: another user's process
        return True
    return True


def remove_dead_staging(folder: str) -> list[str]:
    """Remove the staging folders in cache folder `folder` that builds killed while they wrote left behind (module
    docstring): those of this host and PID namespace whose process is gone, and those not touched (the folder or a
    file in it) for `STALE_AFTER_S`; the names removed, said in one `[data]` line with their size. A live build's
    folder, on this host or another sharing the file system, is kept; nothing here raises."""
    space, removed, freed = _pid_space(), [], 0
    try:
        entries = list(os.scandir(folder))
    except OSError:  # no folder yet
        return []
    for entry in entries:
        name = _STAGING_NAME.fullmatch(entry.name)
        try:
            if name is None or not entry.is_dir(follow_symlinks=False):
                continue
            stats = [entry.stat(follow_symlinks=False)] + [e.stat(follow_symlinks=False) for e in os.scandir(entry)]
        except OSError:  # removed meanwhile (another build swept it), or not ours to read
            continue
        dead = name["space"] == space and not _alive(int(name["pid"]))
        if not dead and time.time() - max(s.st_mtime for s in stats) < STALE_AFTER_S:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.name)
            freed += sum(s.st_size for s in stats[1:] if stat.S_ISREG(s.st_mode))
    if removed:
        log_line(f"[data] data cache folder {folder}: removed {', '.join(removed)} ({size_text(freed)}), left by "
                 "index-cache builds that were killed")
    return removed


def _judged(error: OSError, staging: str) -> OSError:
    """`error`, or a test write's where it hid why: numpy writes an array with C's fwrite, whose short write is an
    OSError without its errno ('3030 requested and 218 written'). The files written so far still take their space
    (the staging folder is not removed yet), so a small write there fails the same way on a full disk, a quota or a
    file-size limit below 1 MiB."""
    if space_errno(error) is not None:
        return error
    probe = probe_write(staging if os.path.isdir(staging) else os.path.dirname(staging))
    return probe if probe is not None and probe.errno in SPACE_ERRNOS else error


def _failed_name(error: OSError, staging: str, names: list[str]) -> str:
    """The cache file whose write failed: the one `error` names (open, rename), else the last one begun in the
    staging folder (numpy's short write names none), or the first (the staging folder could not be made)."""
    named = os.path.basename(os.fsdecode(error.filename)) if error.filename else None
    if named in names:
        return named
    begun = [n for n in names if os.path.exists(os.path.join(staging, n))]
    return begun[-1] if begun else names[0]


class _Kept(Exception):
    """A cache write failed and was kept on the build's `CacheWrites`: the dataset holds placeholders."""


def _writing_rank() -> bool:
    """This rank writes index caches: rank 0; outside torch.distributed, every process."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _writes_here(folder: str | None, names: list[str]) -> bool:
    """Megatron-Core writes this dataset's caches here: this rank writes them (rank 0; outside torch.distributed,
    GPTDataset's every process, and BlendedDataset's asks for the rank) into a cache folder without all of `names`
    whole. A .npy cut short (written in place by an older version of this code, or by stock Megatron-Core, when it
    was killed or the disk was full) is built again and replaced: Megatron-Core counts it present and every start
    failed in numpy.load ('mmap length is greater than file size'). Ours are never cut: written whole or not at all."""
    if not folder or not _writing_rank():
        return False
    return not all(os.path.isfile(path) and (not path.endswith(".npy") or npy_is_whole(path))
                   for path in (os.path.join(folder, n) for n in names))


def _length(n: int, dtype: Any, width: int | None = None) -> numpy.ndarray:
    """A read-only array of `n` zeros (or n x `width`) taking no memory: a placeholder index of the right length."""
    return numpy.broadcast_to(numpy.zeros((1, width) if width else 1, dtype=dtype), (n, width) if width else (n,))


class _StagedIndices:
    """What GPTDataset and BlendedDataset below share: a build's `writes` while the dataset is made, and the indices
    built by Megatron-Core's own method into a staging folder, moved into place whole."""

    def __init__(self, *args: Any, writes: CacheWrites | None = None) -> None:
        self._writes = writes
        try:
            super().__init__(*args)
        finally:
            self._writes = None  # the build's, not the dataset's (and a lock does not pickle)

    def _staged_indices(self, folder: str | None, names: list[str], build_indices: Callable[[], T]) -> T:
        """`build_indices()` (Megatron-Core's method, which reads `self.config.path_to_cache`) where this rank writes
        `names` into `folder`: with the config pointing at a staging folder, the files then moved into `folder`;
        placeholders where this build's writes failed. The staging folders of dead builds in `folder` removed first,
        once a build."""
        if folder and _writing_rank() and (self._writes is None or self._writes.first_visit(folder)):
            remove_dead_staging(folder)
        if not _writes_here(folder, names):
            return build_indices()
        if self._writes is not None and self._writes.failure is not None:
            return self._placeholders()  # the disk is full: this build writes nothing more
        config = self.config

        def build(staging: str) -> T:
            self.config = dataclasses.replace(config, path_to_cache=staging)
            try:
                return build_indices()
            finally:
                self.config = config

        try:
            return _staged(folder, names, self._writes, build)
        except _Kept:
            return self._placeholders()


class GPTDataset(_StagedIndices, gpt_dataset.GPTDataset):
    """Megatron-Core's GPTDataset whose index caches are written whole or not at all (module docstring); `writes`
    keeps a failed write (None: raised). Its name is Megatron-Core's: it names the cache files and their hashes."""

    def _build_document_sample_shuffle_indices(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        config = self.config
        if config.defer_npy_index_mmap or config.fast_cache_load or config.mock:
            return super()._build_document_sample_shuffle_indices()
        folder = config.path_to_cache or os.path.join(self.dataset.path_prefix, "cache",
                                                      f"{type(self).__name__}_indices")
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        names = [f"{base}-{affix}" for affix in ("description.txt", "document_index.npy", "sample_index.npy",
                                                 "shuffle_index.npy")]
        return self._staged_indices(folder, names, super()._build_document_sample_shuffle_indices)

    def _placeholders(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Indices of `num_samples` samples (one when None), as the builder's checks expect; never read."""
        n = self.num_samples or 1
        return _length(1, numpy.int32), _length(n + 1, numpy.int32, 2), _length(n, numpy.uint32)


class BlendedDataset(_StagedIndices, blended_dataset.BlendedDataset):
    """Megatron-Core's BlendedDataset whose index caches are written whole or not at all (module docstring);
    `writes` as GPTDataset's. Its name is Megatron-Core's."""

    def _build_indices(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        config = self.config
        if config.defer_npy_index_mmap or config.fast_cache_load:
            return super()._build_indices()
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
        names = [f"{base}-{affix}" for affix in ("description.txt", "dataset_index.npy", "dataset_sample_index.npy")]
        return self._staged_indices(config.path_to_cache, names, super()._build_indices)

    def _placeholders(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """Indices of `size` samples (the sum of the weights when None), as the builder checks; never read."""
        n = self.size if self.size is not None else int(sum(self.weights))
        return _length(n, numpy.int16), _length(n, numpy.int64)


class DatasetBuilder(BlendedMegatronDatasetBuilder):
    """Megatron-Core's BlendedMegatronDatasetBuilder of `GPTDataset`s (and `BlendedDataset`s), their caches written
    whole or not at all; a failed write kept on `writes` (see the module docstring), not raised."""

    def __init__(self, sizes: list[int | None], is_built_on_rank: Callable[[], bool], config: Any) -> None:
        super().__init__(GPTDataset, sizes, is_built_on_rank, config)
        self.writes = CacheWrites()

    def build_generic_dataset(self, cls: Any, is_built_on_rank: Callable[[], bool], synchronize_ranks: bool,
                              *args: Any) -> Any:
        """Megatron-Core's, constructing this module's BlendedDataset for its own, and both with `writes`."""
        if cls is blended_dataset.BlendedDataset:
            cls = BlendedDataset
        if cls in (GPTDataset, BlendedDataset):
            writes, chosen = self.writes, cls
            cls = lambda *a: chosen(*a, writes=writes)  # noqa: E731
        return super().build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args)
