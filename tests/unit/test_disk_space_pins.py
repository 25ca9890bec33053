"""Pins of megatron_ext.disk_space and checkpoint_space from the mutation audit (round 4): the out-of-space errno
found where torch's writer hides it, the verdict's cleanup and free space (against os.statvfs), the save's size."""

from __future__ import annotations

import errno
import os

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
    hidden = _raised_while_handling(OSError(errno.ENOSPC, "No space left on device"),
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
