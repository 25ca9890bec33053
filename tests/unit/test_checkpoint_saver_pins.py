"""Pins of megatron_ext.checkpoint_saver from the mutation audit (round 8): the trainer's per-step finalize of a
background save says 'saved' only for a save that is in place."""

from __future__ import annotations

from megatron_ext.checkpoint_layout import latest_iteration
from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY


def test_a_pending_background_save_is_not_said_saved(tmp_path, cpu_parallel_state):
    """The loop calls `finalize()` (not blocking) after every step. A background save whose writer has not finished
    stays pending and unsaid; whenever a '[train] saved iter_N' line is out, iter_N is the latest, and the blocking
    finalize says it exactly once. The writer is a forked process, so the first finalize may meet it done or not:
    the assertions hold either way for the real saver. Control: CS16 (finalize pops every pending save, done or
    not: the line is said at once while the latest is still none; killed on each of 3 runs here: the write takes
    longer than the return from save to finalize)."""
    from megatron_ext.checkpoint_saver import CheckpointSaver

    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    lines: list[str] = []
    saver = CheckpointSaver(tmp_path / "ckpt", keep_last=None, background=True, log=lines.append)
    saver.save(1, [model], optimizer=None, scheduler=None, metadata={"hf_config": TINY}, wait=False)
    saver.finalize()
    said = [line for line in lines if line.startswith(f"[train] saved {saver.root}/iter_0000001 ")]
    assert len(said) + len(saver.writing) == 1, (lines, saver.writing)
    assert (latest_iteration(saver.root) == 1) == bool(said), (lines, latest_iteration(saver.root))
    saver.finalize(blocking=True)
    assert latest_iteration(saver.root) == 1 and not saver.writing
    assert [line.split(" (")[0] for line in lines] == [f"[train] saved {saver.root}/iter_0000001"]
