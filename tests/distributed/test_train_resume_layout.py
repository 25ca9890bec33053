"""Resuming on another layout keeps the optimizer state where it can: a run saved at DP=2 and continued at
CP=2 (distributed optimizer) or at TP=2 (plain optimizer) gives the uninterrupted run's losses; where it cannot
(distributed optimizer, TP changed) the run says so and continues with a fresh state, visibly off that path."""

import json
import shutil

import numpy as np
import pytest

from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"


def train(torchrun, out, nproc, data, steps, *overrides):
    stdout = torchrun("megatron_ext.train", nproc, "--recipe", str(RECIPE), f"checkpoint.dir={out}",
                      f"data.prefix={data}", f"train.steps={steps}", "train.seq_length=256",
                      "train.global_batch_size=4", "train.lr=1e-2", "parallel.context=1", *overrides, module=True)
    return stdout, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, torchrun, token_data):
    """Six straight steps at DP=2, and the first three at DP=2 with each optimizer, saved."""
    base = tmp_path_factory.mktemp("layouts")
    _, straight = train(torchrun, base / "straight", 2, token_data, 6)
    train(torchrun, base / "dist3", 2, token_data, 3)
    train(torchrun, base / "plain3", 2, token_data, 3, "train.distributed_optimizer=false")
    return base, straight


def resume(torchrun, token_data, runs, tmp_path, saved, nproc, *overrides):
    base, straight = runs
    out = tmp_path / "run"
    shutil.copytree(base / saved, out)
    stdout, metrics = train(torchrun, out, nproc, token_data, 6, *overrides)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    return stdout, [m["loss"] for m in metrics], [m["loss"] for m in straight]


@pytest.mark.parametrize("saved, overrides", [
    # DP 2 -> CP 2 x DP 1: the distributed optimizer's slices reshard; the two CP ranks share the reading of the
    # weights (the default, each reading all, in every other resume here and in test_train_resume.py)
    ("dist3", ["parallel.context=2", "checkpoint.fully_parallel_load=true"]),
    ("plain3", ["parallel.tensor=2", "train.distributed_optimizer=false"]),  # plain optimizer: any layout
])
def test_resume_on_another_layout_continues_the_run(torchrun, token_data, runs, tmp_path, saved, overrides):
    stdout, losses, straight = resume(torchrun, token_data, runs, tmp_path, saved, 2, *overrides)
    assert "resumed from" in stdout and "parallel layout" in stdout and "fresh optimizer" not in stdout
    np.testing.assert_allclose(losses, straight, atol=1e-5, rtol=0)


def test_tp_change_with_distributed_optimizer_starts_a_fresh_state(torchrun, token_data, runs, tmp_path):
    """Control: a fresh optimizer state (what a TP change forces) moves the losses by far more than 1e-5."""
    stdout, losses, straight = resume(torchrun, token_data, runs, tmp_path, "dist3", 2, "parallel.tensor=2")
    assert "fresh optimizer state" in stdout and "parallel.tensor 1 -> 2" in stdout
    np.testing.assert_allclose(losses[:4], straight[:4], atol=1e-5, rtol=0)  # step 4 runs on the saved weights
    assert abs(losses[4] - straight[4]) > 1e-3


# DP communication overlapped with compute, in buckets of 20,000 of the tiny model's 158K parameters
OVERLAP = ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true", "train.ddp_bucket_size=20000"]


def test_overlapped_communication_gives_the_same_run(torchrun, token_data, runs, tmp_path, cpu_parallel_state):
    """DP 2, two microbatches a step, the gradient reduce-scatter and the parameter all-gather overlapped bucket by
    bucket: the uninterrupted run's losses; saved at step 3 and resumed with the same buckets, it goes on with
    them. The weights saved at step 3 are the plain run's: the parameters the optimizer updated reach the other
    rank only in the next forward, and a save that did not gather them first held weights 0.01 off (what
    weights-only loads, the HF export and evaluation read; a full resume repairs them from the optimizer's state)."""
    from tests.distributed.test_train_async_save import saved_state

    base, straight = runs
    out = tmp_path / "overlap"
    train(torchrun, out, 2, token_data, 3, *OVERLAP)
    ours, plain = saved_state(out / "iter_0000003")[0], saved_state(base / "dist3/iter_0000003")[0]
    weights = [k for k in plain if not k.startswith("optimizer.")]
    assert len(weights) > 5 and all(k in ours for k in weights)
    assert max((ours[k].float() - plain[k].float()).abs().max().item() for k in weights) < 1e-5
    stdout, metrics = train(torchrun, out, 2, token_data, 6, *OVERLAP, "profile.steps=[2,3]")
    assert "resumed from" in stdout and "fresh optimizer" not in stdout
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    # profiling asked for steps the resumed run does not run: said, nothing written
    assert "profile.steps = [2, 3] ran before step 4: nothing traced" in stdout and not (out / "profile").exists()
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in straight], atol=1e-5, rtol=0)


def test_other_gradient_buckets_start_a_fresh_optimizer_state(torchrun, token_data, runs, tmp_path):
    """The distributed optimizer's saved state follows its buckets: one bucket saved, 20,000-parameter buckets
    now, and the run says so and goes on with a fresh state (Megatron-Core's load raised a shape mismatch)."""
    stdout, losses, straight = resume(torchrun, token_data, runs, tmp_path, "dist3", 2, *OVERLAP)
    assert "fresh optimizer state" in stdout and "one bucket when saved, buckets of 20,000 parameters now" in stdout
    np.testing.assert_allclose(losses[:4], straight[:4], atol=1e-5, rtol=0)
    assert abs(losses[4] - straight[4]) > 1e-3


@pytest.fixture(scope="module")
def fully_reshardable(runs, torchrun, token_data):
    """The first three steps at DP=2 again, the distributed optimizer's state saved fully_reshardable, in the
    background."""
    base, _ = runs
    train(torchrun, base / "full3", 2, token_data, 3, "checkpoint.optimizer_sharding=fully_reshardable",
          "checkpoint.async_save=true")
    return "full3"


def test_fully_reshardable_state_resumes_on_any_layout(torchrun, token_data, runs, fully_reshardable, tmp_path):
    """Saved fully_reshardable (the state gathered into the parameters' shapes), the distributed optimizer's state
    follows a PP change and other gradient buckets (a TP change: test_resharded_checkpoint_resumes_at_another_tp):
    the uninterrupted run's losses (a fresh state is off by more than 1e-3 at step 5:
    test_tp_change_with_distributed_optimizer_starts_a_fresh_state)."""
    overrides = ["parallel.pipeline=2", *OVERLAP]  # PP 2 x DP 1, and 20,000-parameter buckets where one was saved
    stdout, losses, straight = resume(torchrun, token_data, runs, tmp_path, fully_reshardable, 2, *overrides)
    assert "resumed from" in stdout and "parallel layout" in stdout and "fresh optimizer" not in stdout
    np.testing.assert_allclose(losses, straight, atol=1e-5, rtol=0)


def test_resharded_checkpoint_resumes_at_another_tp(torchrun, token_data, runs, tmp_path):
    """`tools/checkpoint.py reshard` loads a dp_reshardable checkpoint at its own TP x PP (TP 1 x DP 2 here) and
    saves it fully_reshardable into a new folder: a run at TP 2 resumes its optimizer state and gives the
    uninterrupted run's losses (from the source itself it starts a fresh state:
    test_tp_change_with_distributed_optimizer_starts_a_fresh_state)."""
    from megatron_ext.checkpoint_layout import read_metadata

    base, straight = runs
    out = tmp_path / "any"
    stdout = torchrun(ROOT / "tools/checkpoint.py", 2, "reshard", str(base / "dist3"), "--out", str(out))
    assert f"saved {out}/iter_0000003 with the optimizer state fully_reshardable" in stdout
    meta, source = read_metadata(out), read_metadata(base / "dist3")
    assert meta["optimizer_sharding"] == "fully_reshardable" and meta["resharded_from"]["parallel"]["data"] == 2
    assert all(meta[k] == source[k] for k in ("recipe", "hf_config", "consumed_samples", "tokens", "data_identity"))
    stdout, metrics = train(torchrun, out, 2, token_data, 6, "parallel.tensor=2")
    assert "resumed from" in stdout and "fresh optimizer" not in stdout
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in straight], atol=1e-5, rtol=0)


def test_both_ranks_write_their_share(runs, fully_reshardable):
    """At DP 2 the replicated tensors (the weights; saved fully_reshardable, the optimizer state too) are written
    half by each rank (Megatron-Core's fully parallel save): without it rank 0 wrote 1.7x rank 1's bytes, and
    saved fully_reshardable all of them."""
    base, _ = runs
    for saved in ("dist3", fully_reshardable):
        written = [sum(f.stat().st_size for f in (base / saved / "iter_0000003").glob(f"__{rank}_*.distcp"))
                   for rank in (0, 1)]
        assert max(written) < 1.25 * min(written), (saved, written)
