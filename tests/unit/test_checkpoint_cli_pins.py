"""Pins of `tools/checkpoint.py info` (megatron_ext.checkpoint_cli) from the mutation audit (round 7): what it says
of a checkpoint (its size, gradient buckets, RoPE, latest iteration) and of the run of --recipe (its processes,
layout, data-order warning, nothing to train), and who says an interrupt; each against a fact of the checkpoint on
disk, its metadata or the run's numbers, not the code's own formula."""

import json
import shutil

import pytest

from megatron_ext import checkpoint_cli
from megatron_ext.checkpoint import METADATA_FILE
from tests.unit import test_checkpoint_cli as cli_tests
from tests.unit.test_checkpoint_cli import RECIPE, RUN, _info

ckpt = cli_tests.ckpt  # the fixture: a real tiny checkpoint

SETS = [a for kv in RUN for a in ("--set", kv)]  # the run of the fixture's recipe: 4 samples a step, 10 steps


def _edit_metadata(root, edit) -> None:
    file = root / "iter_0000002" / METADATA_FILE
    meta = json.loads(file.read_text())
    edit(meta)
    file.write_text(json.dumps(meta))


def test_size_counts_the_files_in_decimal_megabytes(ckpt, capsys):
    """'(N files, X MB': N counts the files of the iteration only (a folder left inside it, e.g. by a copy tool, is
    no file of the checkpoint) and X is their bytes / 10^6 (MB, not MiB: CC5, CC6)."""
    it = ckpt / "iter_0000002"
    files = [p for p in it.iterdir() if p.is_file()]
    (it / "stray_folder").mkdir()
    code, out, err = _info(capsys, ckpt)
    assert code == 0, err
    megabytes = sum(p.stat().st_size for p in files) / 10**6
    assert megabytes < 100  # the tiny model: shown in MB
    assert f"iter_0000002: complete ({len(files)} files, {megabytes:.1f} MB; " in out, out


def test_gradient_buckets_shown_with_thousands_separators(ckpt, capsys):
    """A dp_reshardable distributed-optimizer state follows the gradient buckets of the run that saved it
    (train.overlap_grad_reduce with train.ddp_bucket_size): the size is said as the recipe reads, 40,000,000 (CC3)."""
    def overlap(meta):
        meta["recipe"]["train"].update(overlap_grad_reduce=True, ddp_bucket_size=40_000_000)

    _edit_metadata(ckpt, overlap)
    code, out, err = _info(capsys, ckpt)
    assert code == 0, err
    assert "distributed optimizer True (gradient buckets of 40,000,000 parameters)" in out, out


def test_rope_of_a_transformers_5_hf_config(ckpt, capsys):
    """An hf_config in the transformers-5 form keeps its RoPE under `rope_parameters` (no `rope_scaling`): info
    names that rope, not 'default factor 1' (CC10)."""
    def to_v5(meta):
        hf = meta["hf_config"]
        hf["rope_parameters"] = hf.pop("rope_scaling")

    _edit_metadata(ckpt, to_v5)
    code, out, err = _info(capsys, ckpt)
    assert code == 0, err
    assert "rope yarn factor 8.0" in out, out


def test_a_null_angle_precision_is_the_default_one(ckpt, capsys):
    """`rope_angle_precision: null` in an HF config means float64, the default (rope_spec), which info leaves
    unnamed as when the key is absent: no 'angles None' (CC11). float32, the other choice, is named."""
    _edit_metadata(ckpt, lambda meta: meta["hf_config"].update(rope_angle_precision=None))
    code, out, err = _info(capsys, ckpt)
    assert code == 0, err
    assert "rope yarn factor 8.0\n" in out and "angles" not in out, out
    _edit_metadata(ckpt, lambda meta: meta["hf_config"].update(rope_angle_precision="float32"))
    assert "rope yarn factor 8.0, angles float32\n" in _info(capsys, ckpt)[1]


def test_the_data_order_warning_is_said(ckpt, capsys):
    """A run of 20 steps reads 8 + 18 x 4 = 80 samples, the checkpoint's data order was built for its run's
    10 x 4 = 40: info says so, as the trainer's log would (CC13)."""
    code, out, err = _info(capsys, ckpt, "--recipe", RECIPE, "--world-size", "1", *SETS, "--set", "train.steps=20")
    assert code == 0, err
    assert ("  warning: train.steps x train.global_batch_size: this run reads 80 samples, its checkpoint's data order "
            "was built for 40; ") in out, out


def test_the_run_of_recipe_counts_its_processes_and_its_context_parallel(ckpt, capsys):
    """Without --world-size the run has cluster.nodes x cluster.gpus_per_node processes (CC15); its DP is what
    is left of them after TP x PP x CP (CC16): 2 processes at CP 2 are DP 1."""
    code, out, err = _info(capsys, ckpt, "--recipe", RECIPE, *SETS, "--set", "cluster.nodes=2",
                           "--set", "cluster.gpus_per_node=1")
    assert code == 0, err
    assert f"with {RECIPE} on 2 processes:\n" in out and "-> TP 1 x PP 1 x CP 1 x DP 2\n" in out, out
    code, out, err = _info(capsys, ckpt, "--recipe", RECIPE, "--world-size", "2", *SETS, "--set", "parallel.context=2")
    assert code == 0, err
    assert "  layout TP 1 x PP 1 x CP 1 x DP 1 -> TP 1 x PP 1 x CP 2 x DP 1\n" in out, out


def test_set_without_recipe_is_refused(ckpt, capsys):
    """--set describes the run of --recipe: alone it would be dropped unread (CC14)."""
    assert _info(capsys, ckpt, "--set", "train.steps=3") == (
        1, "", "error: --set and --world-size describe the run of --recipe; give --recipe FILE too\n")


@pytest.mark.parametrize("env, said", [({"RANK": "1", "SLURM_PROCID": "0"}, False),
                                       ({"RANK": "0", "SLURM_PROCID": "3"}, True),
                                       ({"SLURM_PROCID": "1"}, False), ({}, True)])
def test_an_interrupt_is_said_once_under_torchrun(tmp_path, capsys, monkeypatch, env, said):
    """torchrun signals every rank, and in a Slurm job started by one task per node every rank of a node has that
    task's SLURM_PROCID: RANK, where set, decides who says it (CC18). The interrupt stands in for a Ctrl-C that
    arrives while the checkpoint is read."""
    for key in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_cli, "describe", interrupted)
    assert _info(capsys, tmp_path) == (130, "", "error: interrupted (Ctrl-C)\n" if said else "")


def test_latest_is_the_latest_also_for_another_iteration(ckpt, capsys):
    """--iteration 1 describes iteration 1; the header still names the run's latest, 2 (CC24: it said 1)."""
    shutil.copytree(ckpt / "iter_0000002", ckpt / "iter_0000001")
    code, out, err = _info(capsys, ckpt, "--iteration", "1")
    assert code == 0, err
    assert out.startswith(f"checkpoint {ckpt}: iterations [1, 2], latest 2\niter_0000001: complete"), out


def test_nothing_to_train_even_when_only_the_weights_would_load(ckpt, capsys):
    """A run at its train.steps trains nothing, whether its optimizer state would have loaded or not (here
    train.precision changed): not 'resumes at step 2 -> 2' (CC22)."""
    code, out, err = _info(capsys, ckpt, "--recipe", RECIPE, "--world-size", "1", *SETS, "--set", "train.steps=2",
                           "--set", "train.precision=bf16")
    assert code == 0, err
    assert out.endswith("on 1 processes:\n  nothing to train: the checkpoint is at step 2, train.steps = 2\n"), out
