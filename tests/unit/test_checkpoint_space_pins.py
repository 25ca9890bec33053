"""Pins of megatron_ext.checkpoint_space from the mutation audit (round 8): the one line a save that ran out of room
says when torch's shard writer hid the errno (judged by a test write under a real file-size limit), the outcome it
names when the folder is in place but the pointer is not, and which failures of a save step become that line.

The file-size limit (RLIMIT_FSIZE, what `ulimit -f` sets) fails a write with EFBIG as a full disk fails it with
ENOSPC, without root or a small file system; SIGXFSZ is ignored meanwhile (its default action ends the process),
and both are put back after each test."""

from __future__ import annotations

import errno
import resource
import signal
from pathlib import Path
from typing import Iterator

import pytest

from megatron_ext.checkpoint_space import CheckpointSpaceError, space_checked, space_verdict
from megatron_ext.disk_space import FILE_SIZE_FIX, SPACE_ERRNOS

# what torch's zip writer raises for a short write (checkpoint_space's docstring): the errno is gone
WRITER_SAID = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.fixture
def file_size_limit() -> Iterator[None]:
    """Writes past 64 KB fail with EFBIG for the test's duration (the 1 MB probe write among them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, xfsz)


def _save_folders(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint root and the unfinished save's temporary folder in it, one shard written."""
    root, tmp = tmp_path / "ckpt", tmp_path / "ckpt" / ".iter_0000002.partial"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"\0" * 4096)
    return root, tmp


def test_a_file_size_limit_torch_hid_is_one_line_with_its_own_fix(tmp_path, file_size_limit):
    """torch said only 'unexpected pos 704 vs 598'; the test write in the save's folder meets the file-size limit:
    the line says 'file too large', how it was judged (the probe's size, torch's words cut to the position pair),
    what the save needs, that nothing was published, and the file-size fix, without a free-space figure (free space
    is beside the point for a size limit). By hand. Pins mutants: EFBIG not told from a full disk (SP1: free space
    shown, the full-disk fix), the fix not swapped (SP2), free space shown for EFBIG (SP3), the basis dropped (SP5),
    notes joined by ', ' (SP6), the position pair matched one digit at a time (SP18), the probe size dropped (SP22)."""
    root, tmp = _save_folders(tmp_path)
    verdict = space_verdict(RuntimeError(WRITER_SAID), root, tmp)
    assert verdict is not None and verdict["errno"] == errno.EFBIG and not tmp.exists()
    said = str(CheckpointSpaceError(root, 2, verdict, 1_600_000))
    assert said == (f"checkpoint folder {root}: {SPACE_ERRNOS[errno.EFBIG]} while saving iteration 2 (the save needs at "
                    "least 1.6 MB; judged by a 1.0 MB test write there: torch's shard writer said only 'unexpected pos "
                    f"704 vs 598'); nothing was published (there is no earlier checkpoint there); {FILE_SIZE_FIX}")


def test_a_writer_error_without_a_position_is_named_by_its_first_line(tmp_path, file_size_limit):
    """An error the probe judges to be out of room but whose text has no 'unexpected pos' is quoted by its first
    line, not its last. Control: SP19 (the last line)."""
    root, tmp = _save_folders(tmp_path)
    verdict = space_verdict(RuntimeError("shard writer failed\nTraceback (most recent call last): ..."), root, tmp)
    assert verdict["basis"] == "judged by a 1.0 MB test write there: torch's shard writer said only 'shard writer failed'"


def test_a_probe_that_fails_for_another_reason_is_no_verdict(tmp_path):
    """A hidden-errno failure whose test write fails for a reason other than room (here the folder is gone:
    ENOENT) is not called out of space: None, so the save's own error is raised. Control: SP13 (any failed probe
    taken for room: a KeyError from the errno table instead of the save's error)."""
    assert space_verdict(RuntimeError(WRITER_SAID), tmp_path / "gone", None) is None


def test_a_first_save_whose_pointer_found_no_room_says_the_latest_is_none(tmp_path):
    """Iteration 1's folder is in place and the latest pointer could not be written: 'the latest is still none',
    not 'iteration None'; with an earlier pointer at iteration 0 (a converted checkpoint's number) the outcome names
    iteration 0, not 'no earlier checkpoint'. Controls: SP9 ('iteration None'), SP10 (0 read as none)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    doing = "pointing latest_checkpointed_iteration.txt at iteration 1"
    verdict = space_verdict(OSError(errno.ENOSPC, "No space left on device"), root, None, doing=doing, published=True)
    assert str(CheckpointSpaceError(root, 1, verdict, None)).endswith(
        "; iter_0000001 is complete but the latest is still none; free space there or save elsewhere")
    (root / "latest_checkpointed_iteration.txt").write_text("0\n")
    verdict = space_verdict(OSError(errno.ENOSPC, "No space left on device"), root, None)
    assert str(CheckpointSpaceError(root, 1, verdict, None)).endswith(
        "; nothing was published: the latest checkpoint is still iteration 0 (iter_0000000); free space there or "
        "save elsewhere")


def test_a_save_step_raises_room_as_one_error_and_other_failures_as_they_were(tmp_path):
    """`space_checked` around a save step that raises torch's CheckpointException: one carrying a full disk becomes
    a CheckpointSpaceError marked alike on every rank (said once); one that is no lack of room (the probe write
    succeeds) is raised as it was. Controls: SP24 (not marked: every rank prints it), SP12 (no verdict still
    reworded: a TypeError)."""
    from torch.distributed.checkpoint.api import CheckpointException

    root, tmp = _save_folders(tmp_path)

    def save_step(cause: BaseException):
        def step() -> None:
            raise CheckpointException("save failed", {0: (cause, None)})
        return space_checked(step, root=root, iteration=2, tmp=tmp, need=4096)

    other = ValueError("a tensor of another shape")
    with pytest.raises(CheckpointException) as raised:
        save_step(other)()
    assert raised.value.failures[0][0] is other and tmp.is_dir()  # nothing removed for an error that is no room
    with pytest.raises(CheckpointSpaceError) as raised:
        save_step(OSError(errno.ENOSPC, "No space left on device"))()
    assert getattr(raised.value, "alike_on_every_rank", False) is True
    assert str(raised.value).startswith(f"checkpoint folder {root}: no space left on device while saving iteration 2")


def test_the_size_a_save_needs_counts_a_models_sharded_tensors(cpu_parallel_state):
    """The model's sharded state dict holds Megatron ShardedTensors (the tensor in `.data`), not tensors: the 'save
    needs at least' figure counts at least every parameter's bytes. Control: SP20 (only bare tensors counted: 0,
    and the figure left out of the line)."""
    from megatron_ext.checkpoint_space import local_bytes
    from megatron_ext.model import BuildOptions, build_model
    from megatron_ext.presets import TINY

    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert params > 0 and local_bytes(model.sharded_state_dict()) >= params
