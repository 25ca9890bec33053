"""Megatron-Core's index-cache writes, made atomic, and a failed one kept for the trainer to tell every rank.

On a cache miss, rank 0's GPTDataset and BlendedDataset write their caches (FOLDER/<md5>-<class>-<split>-*.npy and a
description .txt) straight to their final names, with `numpy.save` and `open`. A full disk, a quota, a file-size
limit or a kill left a cut .npy there; once every name of a build is present Megatron-Core takes it for a cache hit,
and every later start failed in numpy.load ('mmap length is greater than file size'). And the failure surfaced as
Megatron-Core's 'Failed to write dataset materials' traceback on rank 0, while the other ranks waited for rank 0 in
the builder's barrier (gloo: 'Connection closed by peer' tracebacks; NCCL: until the process-group timeout).

`CacheWrites` replaces the `numpy` and `open` that those two modules see, for the span of one build: each file is
written under a temporary name beside its own (`.tmp<pid>`, which no cache lookup matches) and renamed into place
once whole. With `keep_going`, a failed write is not raised but kept (`failure`): its temporary is removed and the
build's later writes are skipped, so that rank 0 passes the builder's barriers with its indices in memory (Megatron-
Core returns those after saving), and the caller can raise it on every rank (`loaders.build_cpt_datasets`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import numpy

from megatron_ext.disk_space import no_space_message, size_text

# the Megatron-Core modules that write index caches, each with `numpy.save` and `open(..., "wt")`
WRITERS = ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset")


class CacheWrites:
    """Within `with CacheWrites(keep_going):`, Megatron-Core's index caches are written atomically; `failure` is the
    first write that failed, as (path, bytes, OSError), when `keep_going` kept it from raising."""

    def __init__(self, keep_going: bool) -> None:
        self.keep_going = keep_going
        self.failure: tuple[str, int, OSError] | None = None
        self._lock = threading.Lock()  # Megatron-Core builds several prefixes in threads
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CacheWrites:
        import importlib

        for name in WRITERS:
            module = importlib.import_module(name)
            self._saved += [(module, "numpy", module.numpy), (module, "open", module.__dict__.get("open"))]
            module.numpy = _Numpy(self)
            module.open = self.open
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attribute, value in reversed(self._saved):
            if value is None:
                module.__dict__.pop(attribute, None)  # `open` is the builtin again
            else:
                setattr(module, attribute, value)
        self._saved.clear()

    def save(self, file: Any, arr: Any, *args: Any, **kwargs: Any) -> None:
        """numpy.save, to `file`'s final name only once whole."""
        if not isinstance(file, (str, os.PathLike)):
            return numpy.save(file, arr, *args, **kwargs)
        nbytes = getattr(numpy.asarray(arr), "nbytes", 0)
        # through a plain object's write: numpy hands a real file to C (tofile), whose short write is an OSError
        # without its errno ('1080 requested and 218 written'); Python's write keeps it (ENOSPC, EDQUOT, EFBIG)
        self._write(os.fspath(file), nbytes, lambda f: numpy.save(_Writer(f), arr, *args, **kwargs), "wb")

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        """The builtin open, but a file opened to write (the cache's description) is written on close, atomically."""
        if not set(mode) & set("wax+") or not isinstance(file, (str, os.PathLike)):
            return open(file, mode, *args, **kwargs)
        return _Pending(self, os.fspath(file), mode)

    def _write(self, path: str, nbytes: int, write: Callable[[Any], None], mode: str) -> None:
        if self.failure is not None:  # a build that failed writes nothing more: the disk is full
            return
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, mode) as f:
                write(f)
            os.replace(tmp, path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)  # its space back; the final name was never touched
            if not self.keep_going:
                raise
            with self._lock:
                self.failure = self.failure or (path, nbytes, e)

    def said(self) -> str | None:
        """One line for `failure` (the cache folder, the space left there, the file, the fix), or None."""
        if self.failure is None:
            return None
        path, nbytes, error = self.failure
        folder, name = os.path.split(path)
        outcome = (f"writing the index cache {name}{f' ({size_text(nbytes)})' if nbytes >= 10**5 else ''} failed and left "
                   "nothing there; the datasets were not built")
        return (no_space_message(error, f"data cache folder {folder}", folder, outcome,
                                 "free space there or set data.cache_dir to a folder with room")
                or f"data cache folder {folder}: cannot write {name} ({error.strerror or error}); the datasets were "
                   "not built; set data.cache_dir to a folder this job can write")


class _Numpy:
    """The numpy module as Megatron-Core's cache writers see it inside `CacheWrites`: `save` is atomic."""

    def __init__(self, writes: CacheWrites) -> None:
        self._writes = writes

    def __getattr__(self, name: str) -> Any:
        return getattr(numpy, name)

    def save(self, file: Any, arr: Any, *args: Any, **kwargs: Any) -> None:
        self._writes.save(file, arr, *args, **kwargs)


class _Writer:
    """A file seen only through its `write` (numpy then writes the array in 16 MiB pieces with it)."""

    def __init__(self, f: Any) -> None:
        self.write = f.write


class _Pending:
    """A text file opened to write: what is written is kept, and written atomically on close."""

    def __init__(self, writes: CacheWrites, path: str, mode: str) -> None:
        self._writes, self._path, self._mode, self._parts = writes, path, mode, []

    def write(self, text: Any) -> int:
        self._parts.append(text)
        return len(text)

    def close(self) -> None:
        parts, self._parts = self._parts, None
        if parts is not None:
            data = "".join(parts) if "b" not in self._mode else b"".join(parts)
            self._writes._write(self._path, len(data), lambda f: f.write(data), "wb" if "b" in self._mode else "w")

    def __enter__(self) -> _Pending:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if kind is None:
            self.close()
        else:
            self._parts = None  # the block failed: nothing is written
