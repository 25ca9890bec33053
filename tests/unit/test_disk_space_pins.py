"""Pins of megatron_ext.disk_space and checkpoint_space from the mutation audits (rounds 4 and 9): the out-of-space
errno found where torch's writer hides it, the verdict's cleanup and free space (against os.statvfs), the save's size;
an error that is its own cause, the words of a quota, the probe write that leaves nothing."""

from __future__ import annotations

import errno
import os
import resource
import signal
import threading

import pytest
import torch

from megatron_ext.checkpoint_space import local_bytes, space_verdict
from megatron_ext.disk_space import free_bytes, space_errno


def _raised_while_handling(inner: BaseException, outer: BaseException) -> BaseException:
    """`outer` raised in the except block of `inner` (implicit chaining: `inner` is only its __context__)."""
    try:
        try:
            raise inner
        except type(inner):
            raise outer
    except type(outer) as e:
        return e


def test_an_errno_only_in_the_context_is_found():
    """torch's zip writer raises 'unexpected pos' while handling the short write's OSError, which is then only the
    RuntimeError's __context__ (not __cause__): the errno is still found. Control: following __cause__ alone."""
    hidden = _raised_while_handling(
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    assert hidden.__cause__ is None and space_errno(hidden) == errno.ENOSPC
    assert space_errno(_raised_while_handling(ValueError("x"), RuntimeError("unexpected pos 1 vs 2"))) is None


def test_a_space_verdict_removes_the_saves_temporary_folder(tmp_path):
    """After a save that ran out of room the verdict removes its temporary folder (the space back, nothing loads
    it) and reports the free space of the checkpoint folder's file system (os.statvfs: f_bavail x f_frsize).
    Control: the folder left behind."""
    root, tmp = tmp_path / "ckpt", tmp_path / "ckpt" / ".tmp_iter_0000002"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"\0" * 4096)
    verdict = space_verdict(OSError(errno.ENOSPC, "No space left on device"), root, tmp)
    assert verdict["errno"] == errno.ENOSPC and verdict["reason"] == "no space left on device"
    assert not tmp.exists() and root.is_dir()
    st = os.statvfs(root)
    assert verdict["free"] == pytest.approx(st.f_bavail * st.f_frsize, abs=256 << 20)
    assert free_bytes(root / "not" / "made") == pytest.approx(st.f_bavail * st.f_frsize, abs=256 << 20)
    assert space_verdict(ValueError("not a write"), root, None) is None


def test_local_bytes_counts_bytes_not_elements():
    """The save needs at least the bytes of the tensors it holds: 10 bf16 (2 B) + 3 fp32 (4 B) = 32 bytes, by hand.
    Control: elements counted (13)."""
    state = {"a": torch.zeros(10, dtype=torch.bfloat16), "b": [torch.zeros(3, dtype=torch.float32)], "n": 7}
    assert local_bytes(state) == 10 * 2 + 3 * 4


def test_an_errno_known_only_by_its_words_is_found():
    """A writer process passes its error on as text; without '[Errno 28]' the strerror words still tell it
    (os.strerror). Control: only the '[Errno N]' form recognised."""
    assert space_errno(RuntimeError(f"shard writer failed: {os.strerror(errno.EDQUOT)}")) == errno.EDQUOT
    assert space_errno(RuntimeError(f"[Errno {errno.ENOSPC}] whatever")) == errno.ENOSPC


def test_sizes_in_megabytes_below_ten_gigabytes():
    """size_text: decimal MB below 10 GB (10**10 bytes), GB from there, one decimal; by hand."""
    from megatron_ext.disk_space import size_text

    assert [size_text(n) for n in (3_400_000, 5 * 10**9, 10**10 - 10**6, 10**10, 12 * 10**9)] == [
        "3.4 MB", "5000.0 MB", "9999.0 MB", "10.0 GB", "12.0 GB"]


# mutation audit round 9


def test_an_error_that_is_its_own_cause_is_judged_once():
    """`raise e from e` (or a cause whose context is the error) makes a loop of causes: each error is read once and
    the answer comes (DS1: the seen set dropped, and the reading never ended)."""
    looped = RuntimeError("checkpoint writer failed")
    looped.__cause__ = looped
    inner = ValueError("not a write")
    inner.__context__, looped.__context__ = looped, inner
    answer = []
    thread = threading.Thread(target=lambda: answer.append(space_errno(looped)), daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert answer == [None]


def test_a_quota_is_said_in_the_systems_words(tmp_path):
    """An EDQUOT write is said as the system says it (os.strerror: 'Disk quota exceeded'), with the free space, the
    outcome and the fix; a full disk as 'No space left on device' (DS20: a quota said as a full disk)."""
    from megatron_ext.disk_space import no_space_message

    for number in (errno.EDQUOT, errno.ENOSPC):
        said = no_space_message(OSError(number, os.strerror(number)), "--out x", tmp_path, "nothing written", "fix it")
        assert said.startswith(f"--out x: {os.strerror(number).lower()} (") and said.endswith(
            " free there); nothing written; fix it"), said


def test_a_probe_write_leaves_nothing_behind(tmp_path):
    """probe_write: None where 1 MB fits, and the probe file removed after, also when its write failed (EFBIG under
    a 64 KB file-size limit: the error returned). DS11: the probe files left in the user's folder."""
    from megatron_ext.disk_space import probe_write

    assert probe_write(tmp_path) is None and not list(tmp_path.iterdir())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        failed = probe_write(tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, xfsz)
    assert isinstance(failed, OSError) and failed.errno == errno.EFBIG and not list(tmp_path.iterdir())


def test_an_errno_only_in_an_explicit_cause_is_found():
    """`raise RuntimeError(...) from oserror` outside an except block: the OSError is the __cause__ and there is no
    __context__; its errno is found (DS22: the walk stopped at the first missing link, the absent context)."""
    cause = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    try:
        raise RuntimeError("saving iteration 2 failed") from cause
    except RuntimeError as e:
        wrapped = e
    assert wrapped.__context__ is None and space_errno(wrapped) == errno.EDQUOT


def test_an_error_that_is_not_about_room_gets_no_room_line(tmp_path):
    """A write refused for another reason (EACCES: a read-only folder) is no out-of-space line: None, and the caller
    says the error as it is (DS23: said as 'no space left on device')."""
    from megatron_ext.disk_space import no_space_message

    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "x"))
    assert no_space_message(denied, "--out x", tmp_path, "nothing written", "fix it") is None


def test_the_free_space_is_read_where_the_output_goes(small_disk):
    """The free space in the line is that of the output's own file system: a full 64 kB tmpfs mounted there says
    ~0 MB (os.statvfs of it), not the GBs of the disk it is mounted on (DS24: read at the parent folder)."""
    from megatron_ext.disk_space import no_space_message

    with open(small_disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 4096)
    st = os.statvfs(small_disk)
    said = no_space_message(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "--out x", small_disk, "done", "fix")
    assert said == f"--out x: no space left on device ({st.f_bavail * st.f_frsize / 1e6:.1f} MB free there); done; fix"
