"""Atomic output: write to a temporary file beside the target, then rename it into place.

A crash or Ctrl-C never leaves a half-written results.json or PNG where a good one was expected. And an output
folder that cannot be written is found before the work (`check_writable_folder`), not at its first save.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from megatron_ext.evaluate.errors import EvalError


def current_umask() -> int:
    """The process's umask (read by setting it and back): the permissions mkstemp/mkdtemp's 0600/0700 should get."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


class OutputWriteError(OSError):
    """`write_atomic` could not write its file: an OSError still (with the errno, for callers that handle a full
    disk), whose `what` says what failed ("cannot write DIR/results.json"), for a one-line error."""

    def __init__(self, error: OSError, what: str) -> None:
        super().__init__(error.errno, error.strerror or str(error), error.filename)
        self.what = what

    def __str__(self) -> str:
        return f"{self.what} ({self.strerror})"


def write_atomic(path: str | Path, write: Callable[[Any], None], mode: str = "w") -> Path:
    """Call `write(f)` on a new file beside `path` (a unique name: two writers never share one), then rename it
    into place; on any error the temporary file is removed and `path` is left as it was. Returns the path.
    An OSError is raised as OutputWriteError, naming the folder or file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # a link to nowhere, a file where a folder goes: a traceback after hours of evaluation
        raise OutputWriteError(e, f"cannot create {path.name} in the folder {path.parent}") from None
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OutputWriteError(e, f"cannot write {path}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable_folder(path: str | Path | None, flag: str) -> None:
    """EvalError naming `flag`, the path and the fix unless a folder can be made and written at `path`
    (`cli_types.folder_write_problem`; None: no output, nothing to check)."""
    from megatron_ext.cli_types import folder_write_problem

    problem = None if path is None else folder_write_problem(path)
    if problem:
        raise EvalError(f"{flag} {path}: {problem}")


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON to `path` atomically; returns the path."""
    return write_atomic(path, lambda f: f.write(json.dumps(obj, indent=2) + "\n"), "w")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically; returns the path."""
    return write_atomic(path, lambda f: f.write(text), "w")


def save_figure_atomic(fig: Any, path: str | Path) -> Path:
    """Save a matplotlib `Figure` as PNG to `path` atomically; returns the path."""
    return write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=fig.get_dpi(), bbox_inches="tight"), "wb")


def model_version(path: str | Path) -> str | None:
    """What tells one save of a model from another at the same path: a Megatron checkpoint's iteration and the time
    it was written, or an HF directory's weight files with their sizes and modification times. None if unknown."""
    path = Path(path)
    try:
        from megatron_ext.checkpoint_index import CheckpointError
        from megatron_ext.checkpoint_layout import read_metadata

        try:
            meta = read_metadata(path)
            return f"iteration {meta.get('iteration')}, written {meta.get('created')}"
        except CheckpointError:
            pass
        weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
        return "; ".join(f"{w.name} {w.stat().st_size} B {w.stat().st_mtime_ns}" for w in weights) or None
    except OSError:
        return None


def read_utf8(path: Path, flag: str) -> str:
    """The text of a file a flag names; EvalError (naming the flag, file and byte) when it is not UTF-8: a binary
    file read with replacement characters would make a haystack or a document of garbage without a word."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start}); give a UTF-8 text file") \
            from None


def not_there(path: Path, want: str = "file") -> str:
    """Why `path` is not the file (or folder, `want`) asked for: 'does not exist', or what it is instead."""
    if not path.exists():
        return "does not exist"
    return "is a folder, not a file" if want == "file" else "is a file, not a folder"
