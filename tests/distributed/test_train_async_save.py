"""Background checkpoint saves (`checkpoint.async_save`): the same checkpoints as saves in place. Their kill -9
and signal tests are in test_train_resume.py (beside the same tests of saves in place), the divergence test in
test_train_errors.py."""

import json
import re
import subprocess
import sys

import torch

from megatron_ext.checkpoint_index import check_complete
from tests.conftest import ROOT
from tests.distributed.test_train_resume import latest, metrics

RECIPE = ROOT / "recipes/tiny/cpt.yaml"
ASYNC = "checkpoint.async_save=true"


def run_cp2(torchrun, out, data, *overrides):
    return torchrun("megatron_ext.train", 2, "--recipe", str(RECIPE), f"checkpoint.dir={out}", f"data.prefix={data}",
                    "train.steps=4", "train.seq_length=256", "train.global_batch_size=2", "train.lr=1e-2",
                    "checkpoint.interval=1", "checkpoint.keep_last=2", *overrides, module=True)


def flat_tensors(tree, prefix=""):
    """Every tensor of a loaded state (nested dicts/lists), by dotted path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out = {}
    for key, value in items:
        out.update(flat_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def saved_state(folder):
    from megatron.core import dist_checkpointing

    tensors = flat_tensors(dist_checkpointing.load_plain_tensors(str(folder)))
    common = dist_checkpointing.load_common_state_dict(str(folder))
    return tensors, common["scheduler"]


def test_background_saves_equal_saves_in_place(tmp_path, torchrun, token_data, cpu_parallel_state):
    """CP 2, the distributed optimizer: model, optimizer and scheduler state of each kept iteration bit for bit,
    keep_last applied when a background save is finalised, nothing left of the temporary folders."""
    sync_log = run_cp2(torchrun, tmp_path / "sync", token_data)
    log = run_cp2(torchrun, tmp_path / "async", token_data, ASYNC)
    sync, background = tmp_path / "sync", tmp_path / "async"
    assert sorted(p.name for p in background.iterdir()) == sorted(p.name for p in sync.iterdir()) == [
        "iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    assert latest(background) == 4 and log.count("[train] saved ") == 4
    # the save lines say what they cost: in place, the save; in the background, also what the loop waited
    assert len(re.findall(r"\[train\] saved \S+iter_000000\d \(\d+\.\d s\)", sync_log)) == 4, sync_log
    assert len(re.findall(r"\(in the background: in place \d+\.\d s after it began; the loop waited \d+\.\d s\)",
                          log)) == 4, log
    assert [m["loss"] for m in metrics(background)] == [m["loss"] for m in metrics(sync)]
    for it in ("iter_0000003", "iter_0000004"):
        check_complete(background / it)
        (a, a_sched), (b, b_sched) = saved_state(background / it), saved_state(sync / it)
        assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a), sorted(a)[:8]
        assert not [k for k in a if not torch.equal(a[k], b[k])]
        assert a_sched == b_sched and a_sched["num_steps"] == int(it[5:])
        ours, theirs = (json.loads((d / it / "megatron_ext.json").read_text()) for d in (background, sync))
        assert ours["recipe"]["checkpoint"]["async_save"] and not theirs["recipe"]["checkpoint"]["async_save"]
        assert {k: v for k, v in ours.items() if k not in ("created", "recipe")} == {
            k: v for k, v in theirs.items() if k not in ("created", "recipe")}
    # control: the comparison sees a change of state (one step of training apart)
    a3, _ = saved_state(background / "iter_0000003")
    a4, _ = saved_state(background / "iter_0000004")
    assert [k for k in a3 if not torch.equal(a3[k], a4[k])]


def test_checkpoint_save_bench_runs_at_toy_size(tmp_path, torchrun):
    """bench/checkpoint_save_bench.py stays runnable, at DP 2 with both optimizer formats; its stall ratio is to the
    in-place baseline of the same run."""
    torchrun(ROOT / "bench/checkpoint_save_bench.py", 2, "--hidden", "128", "--layers", "1", "--ffn", "256",
             "--vocab", "512", "--saves", "1", "--fully-reshardable", "--dir", str(tmp_path / "ckpt"),
             "--out", str(tmp_path))
    (path,) = tmp_path.glob("checkpoint_save-cpu-*.json")
    result = json.loads(path.read_text())
    modes = ["in_place", "background", "in_place fully_reshardable", "background fully_reshardable"]
    assert list(result["rows"]) == modes and result["rows"]["in_place"]["stall_ratio"] == 1.0
    assert result["data_parallel"] == 2
    assert result["checkpoint_bytes"] > 12 * result["params"]  # fp32 weights, master copy and two Adam moments
    for mode in modes:
        assert latest(tmp_path / "ckpt" / mode.replace(" ", "_")) == 2
        assert len(result["rows"][mode]["bytes_by_rank"]) == 2 and min(result["rows"][mode]["bytes_by_rank"]) > 0
        meta = json.loads((tmp_path / "ckpt" / mode.replace(" ", "_") / "iter_0000002/megatron_ext.json").read_text())
        assert meta["optimizer_sharding"] == ("fully_reshardable" if "fully" in mode else "dp_reshardable")
    bad = subprocess.run([sys.executable, str(ROOT / "bench/checkpoint_save_bench.py"), "--hidden", "100"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 1 and "--hidden" in bad.stderr and "Traceback" not in bad.stderr
