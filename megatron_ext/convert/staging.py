"""Output staging (temp folder renamed into place on success), peak memory, process group setup."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import resource
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Iterator

from megatron_ext.cli_types import nearest_existing
from megatron_ext.convert.hf_io import ConvertError


def check_separate(out: Path, source: Path, source_flag: str) -> None:
    """Refuse an `--out` that is the source folder, lies inside it or contains it.

    Replacing `out` (with --force) would delete the source; writing inside it would mix the export
    into the checkpoint being read.
    """
    o, s = Path(out).resolve(), Path(source).resolve()
    if o == s or s in o.parents or o in s.parents:
        raise ConvertError(f"--out {out}: overlaps {source_flag} {source} (the folder being converted); "
                           "write the output to a separate folder")


# What a conversion writes at its --out, by kind: `--force` replaces a folder holding only these (or nothing).
_MEGATRON = "megatron"
_HF = "hf"
_KIND_NAMES = {_MEGATRON: "a Megatron checkpoint", _HF: "a Hugging Face model folder"}
_OTHER_COMMAND = {_MEGATRON: "to-hf", _HF: "to-megatron"}


def _output_kind(name: str, is_dir: bool) -> str | None:
    """The kind of conversion output a folder entry belongs to (None: no conversion writes it)."""
    from megatron_ext.checkpoint_layout import LATEST_FILE
    from megatron_ext.convert.hf_io import GENERATION_CONFIG, TOKENIZER_FILES

    if is_dir:  # iteration folders, and a save that was interrupted
        return _MEGATRON if re.fullmatch(r"iter_\d+|\.iter_\d+\.partial", name) else None
    if name == LATEST_FILE:
        return _MEGATRON
    if name in ("config.json", GENERATION_CONFIG, "model.safetensors.index.json", *TOKENIZER_FILES) \
            or name.endswith(".safetensors"):
        return _HF
    return None


def _listing(names: list[str], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def check_out(out: Path, force: bool, kind: str) -> None:
    """Refuse an `--out` the conversion may not write: an existing one without `force`; with `force`, anything but
    an empty folder or a previous output of the same `kind` ("megatron": latest_checkpointed_iteration.txt and
    iter_* folders; "hf": config.json, *.safetensors, the generation config and tokenizer files). `--force` once
    deleted whatever folder --out named (notes, data sets, another model)."""
    out = Path(out)
    _destination(out)  # a dangling symlink is refused here, before any work (rename onto it failed at the end)
    if not out.exists():
        above = nearest_existing(out.absolute().parent)
        if not above.is_dir():  # mkdir said only 'File exists: ABOVE'
            raise ConvertError(f"--out {out}: {above} is a file, not a folder; choose another path")
        return
    if not out.is_dir():
        raise ConvertError(f"--out {out} is a file, not a folder; choose another path")
    try:
        entries = sorted(out.iterdir(), key=lambda p: p.name)
    except OSError as e:
        raise ConvertError(f"--out {out}: cannot list it ({e.strerror or e}); choose another path") from None
    kinds = {p.name + ("/" if p.is_dir() else ""): _output_kind(p.name, p.is_dir()) for p in entries}
    foreign = [name for name, k in kinds.items() if k is None]
    found = {k for k in kinds.values() if k is not None}
    if foreign:
        raise ConvertError(f"--out {out} holds {_listing(foreign)} (not a checkpoint); --force replaces only a "
                           "previous conversion; give a new --out")
    if found - {kind}:
        other = (found - {kind}).pop()
        raise ConvertError(f"--out {out} is {_KIND_NAMES[other]}, not {_KIND_NAMES[kind]}: --force replaces only a "
                           f"previous output of this command, not one of {_OTHER_COMMAND[kind]}; give a new --out")
    if not force:
        what = "an empty folder" if not entries else _KIND_NAMES[kind]
        raise ConvertError(f"--out {out} already exists ({what}); choose another path or pass --force to replace it")


def _destination(out: Path) -> Path:
    """The folder a conversion writes for `--out out`: `out` itself, or the folder a symlink `out` points to.

    A symlinked --out (to a folder on a bigger disk) means its target: the output is staged beside the target, on
    its file system, and renamed onto it; the link stays. Replacing the link itself filled the link's file system
    and left the target as it was. A dangling link is a ConvertError: the rename onto it fails only at the end.
    """
    given, out = Path(out), Path(out).absolute()
    if not out.is_symlink():
        return out
    target = Path(os.readlink(out))
    if not out.exists():
        raise ConvertError(f"--out {given} is a symlink to {target}, which does not exist; create that folder "
                           f"(mkdir -p {out.parent / target}) or give another --out")
    return out.resolve()


_staged = 0  # staged_output blocks this process has entered (with a temporary folder made)


def stagings_begun() -> int:
    """How many outputs this process has begun to stage: compared before and after a conversion, it tells an
    interrupt before any output was written ("nothing was written") from one whose temporary folder was removed."""
    return _staged


@contextlib.contextmanager
def staged_output(out: Path, force: bool, kind: str) -> Iterator[Path]:
    """Yield a temporary folder beside `out` (beside its target if it is a symlink); rename it to `out` only if the
    block succeeds.

    An existing `out` is an error unless `force` and it is empty or a previous output of `kind` (`check_out`),
    and is replaced only after the new one is complete. Any exception, including KeyboardInterrupt (Ctrl-C, and
    SIGTERM under `sigterm_as_interrupt`), removes the temporary folder: it is as large as the model.
    """
    check_out(out, force, kind)
    given, out = out, _destination(out)
    tmp = out.parent / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:  # a parent that is a file, a read-only or virtual file system (/proc), no permission
        raise ConvertError(f"--out {given}: cannot create a folder there ({e.strerror or e}: {e.filename}); "
                           "choose a writable path") from None
    global _staged
    _staged += 1
    try:
        yield tmp
    except BaseException:
        with _signals_held():  # a second Ctrl-C / SIGTERM must not cut the cleanup short
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # A signal between the two renames would leave neither folder at `out`, one during the removal a
    # full-size `.old` folder: hold signals until both are done (a few file deletions).
    with _signals_held():
        _check_out_again(given, out, force, kind, tmp)
        old = out.parent / f".{out.name}.old-{os.getpid()}" if out.exists() else None
        try:
            if old is not None:
                os.replace(out, old)
            os.replace(tmp, out)
        except OSError as e:  # something put at `out` meanwhile (a file, a link), the file system gone read-only
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not out.exists():
                with contextlib.suppress(OSError):
                    os.replace(old, out)
            raise ConvertError(f"--out {given}: cannot move the finished output into place ({e.strerror or e}: "
                               f"{out}); it was removed and --out left as it was; check --out and convert "
                               "again") from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _check_out_again(given: Path, out: Path, force: bool, kind: str, tmp: Path) -> None:
    """`check_out` once more, just before the rename: what appeared at --out during the conversion (another
    command's output, the user's files) was moved aside and deleted. The finished output is not thrown away with the
    error: it is renamed to a visible `OUT.converted-PID` beside --out, which no later conversion removes."""
    if not out.exists():
        return
    try:
        check_out(out, force, kind)
    except ConvertError as e:
        kept = out.parent / f"{out.name}.converted-{os.getpid()}"
        try:
            os.replace(tmp, kept)
        except OSError:
            kept = tmp
        raise ConvertError(f"--out {given} changed while converting and was left as it is ({e}); the finished "
                           f"output is kept at {kept}: move it where you want it") from None


def _remove_stale_staging(out: Path) -> None:
    """Remove the staging folders beside `out` that a conversion on this host left when it was killed (SIGKILL,
    the out-of-memory killer: no cleanup ran), each as large as the model. Only this host's, and only those of
    processes that no longer run: another node's conversion may be writing its own on a shared file system."""
    mine = f".{out.name}.partial-{socket.gethostname()}-"
    for folder in out.parent.glob(f"{glob.escape(mine)}*"):
        pid = folder.name[len(mine):]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            print(f"note: removing {folder}, left by an interrupted conversion (process {pid})", file=sys.stderr)
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # another user's running process
            pass


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Delay SIGINT and SIGTERM until the block ends (they are delivered then, not lost)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process and of its finished children (checkpoint writer helpers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) * 1024  # Linux reports KiB


def ensure_cpu_process_group() -> None:
    """A single-process gloo group and Megatron parallel state (TP=PP=1) unless one is already set up."""
    import torch
    from megatron.core import parallel_state

    from megatron_ext.runtime import init_distributed

    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized() \
            and parallel_state.get_tensor_model_parallel_world_size() == 1 \
            and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != 1:
        raise ConvertError("the converter runs in one process; do not start it under torchrun")
    init_distributed("cpu")
