"""megatron_ext.checkpoint_reshard pinned where the mutation audit (round 6) found it untested: the conversion run's
layout (the saved TP x PP, CP 1, the rest DP), the saved gradient buckets, and which checkpoints and --out folders
are refused, with which words. On metadata-only checkpoints (`reshard_plan` reads nothing else)."""

from __future__ import annotations

import json

import pytest

from megatron_ext.checkpoint_index import CheckpointError, gradient_bucket_size
from megatron_ext.checkpoint_reshard import reshard_plan
from megatron_ext.recipe import load_recipe
from tests.unit.test_checkpoint_cli import ckpt  # noqa: F401  (the fixture: a real step-2 checkpoint)
from tests.unit.test_output_paths import _run_checkpoint


def _edited(tmp_path, edit):
    """_run_checkpoint's checkpoint root with its metadata changed by `edit(meta)`."""
    root = _run_checkpoint(tmp_path)
    meta_file = root / "iter_0000002/megatron_ext.json"
    meta = json.loads(meta_file.read_text())
    edit(meta)
    meta_file.write_text(json.dumps(meta))
    return root


def _layout(meta, tensor, pipeline, context, data, *train):
    meta["parallel"] = {"tensor": tensor, "pipeline": pipeline, "context": context, "data": data}
    meta["recipe"]["parallel"].update(tensor=tensor, pipeline=pipeline, context=context)
    meta["recipe"]["train"].update(distributed_optimizer=True)
    for key, value in train:
        meta["recipe"]["train"][key] = value


def test_the_conversion_runs_at_the_saved_tp_pp_with_cp_1_and_the_rest_dp(tmp_path):
    """Saved at TP 2 x PP 2 x CP 2, resharded on 8 processes: TP 2 x PP 2 x CP 1 x DP 2, one sample per DP rank
    and step (global batch 2), the state saved fully_reshardable."""
    root = _edited(tmp_path, lambda m: _layout(m, 2, 2, 2, 1))
    _, saved, overrides = reshard_plan(root, tmp_path / "new", None, 8)
    recipe = load_recipe(raw=saved["recipe"], overrides=overrides, world_size=8)
    p = recipe.parallel
    assert (p.tensor, p.pipeline, p.context) == (2, 2, 1)
    assert (recipe.train.global_batch_size, recipe.train.micro_batch_size) == (2, 1)
    assert recipe.checkpoint.optimizer_sharding == "fully_reshardable"


def test_the_saved_gradient_buckets_are_kept(tmp_path):
    """With train.overlap_grad_reduce and no train.ddp_bucket_size a run at DP 64 had buckets of max(40M, 1M x 64)
    = 64M parameters (Megatron-Core's DDP); the conversion run, at DP 1, is given that size (its own default would
    be 40M, other buckets that cannot read the saved state)."""
    root = _edited(tmp_path, lambda m: _layout(m, 1, 1, 1, 64, ("overlap_grad_reduce", True), ("ddp_bucket_size", None)))
    _, saved, overrides = reshard_plan(root, tmp_path / "new", None, 1)
    recipe = load_recipe(raw=saved["recipe"], overrides=overrides, world_size=1)
    assert gradient_bucket_size(recipe.train.overlap_grad_reduce, recipe.train.ddp_bucket_size, 1) == 64_000_000


def test_a_pipeline_split_needs_its_multiple_of_processes(tmp_path):
    root = _edited(tmp_path, lambda m: _layout(m, 1, 2, 1, 1))
    with pytest.raises(CheckpointError, match=r"was saved at TP 1 x PP 2: reshard it on a multiple of TP x PP = 2 "
                                              r"processes \(got 3\)"):
        reshard_plan(root, tmp_path / "new", None, 3)
    assert reshard_plan(root, tmp_path / "new", None, 4)[2][:2] == ["parallel.tensor=1", "parallel.pipeline=2"]


def test_a_checkpoint_from_before_has_optimizer_is_resharded(tmp_path):
    """Checkpoints from before the `has_optimizer` field hold their optimizer state: only False refuses."""
    root = _edited(tmp_path, lambda m: m.pop("has_optimizer"))
    path, _, _ = reshard_plan(root, tmp_path / "new", None, 1)
    assert path == root / "iter_0000002"


def test_out_folders_refused_in_their_own_words(tmp_path):
    """--out the checkpoint folder itself is named as such (not as a folder that is not empty); a folder with an
    interrupted save beside other content is not empty, not 'only the unfinished save'."""
    root = _run_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="is, or lies inside, the checkpoint folder"):
        reshard_plan(root, root, None, 1)
    mixed = tmp_path / "mixed"
    (mixed / ".iter_0000002.partial").mkdir(parents=True)
    (mixed / "notes.txt").write_text("")
    with pytest.raises(CheckpointError, match="exists and is not empty: pick a new folder"):
        reshard_plan(root, mixed, None, 1)
    (mixed / "notes.txt").unlink()  # the control: only the partial save
    with pytest.raises(CheckpointError, match="holds only the unfinished save of an interrupted run"):
        reshard_plan(root, mixed, None, 1)


def test_a_reshard_carries_the_run_over(ckpt, tmp_path):  # noqa: F811
    """A complete `tools/checkpoint.py reshard` (one process, the real load and save): the new folder holds the same
    iteration saved fully_reshardable, where it came from (the source folder and layout), the run's position and
    recipe as the source recorded them, and its metrics.jsonl; no staging folder is left beside it, and a killed reshard's (what it held)
    is not carried into it."""
    import os
    import subprocess
    import sys

    from megatron_ext.checkpoint_layout import read_metadata
    from tests.conftest import ROOT

    (ckpt / "metrics.jsonl").write_text('{"step": 1, "loss": 6.5}\n{"step": 2, "loss": 6.25}\n')
    source = read_metadata(ckpt / "iter_0000002")
    (tmp_path / ".new.partial").mkdir()  # a killed reshard's staging folder, with what it had written
    (tmp_path / ".new.partial/stray").write_text("")
    proc = subprocess.run([sys.executable, str(ROOT / "tools/checkpoint.py"), "reshard", str(ckpt), "--out",
                           str(tmp_path / "new")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = tmp_path / "new/iter_0000002"
    assert proc.stdout.splitlines()[-1].startswith(f"saved {new} with the optimizer state"), proc.stdout
    meta = read_metadata(new)
    assert meta["optimizer_sharding"] == "fully_reshardable"
    assert meta["resharded_from"] == {"path": str(ckpt / "iter_0000002"), "parallel": source["parallel"]}
    assert (meta["consumed_samples"], meta["tokens"], meta["recipe"]) == (8, 2048, source["recipe"])
    assert (tmp_path / "new/metrics.jsonl").read_text() == (ckpt / "metrics.jsonl").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "run"]
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt",
                                                                    "metrics.jsonl"]
