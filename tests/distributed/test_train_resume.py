"""Resume is exact (kill -9 mid-run, resume: bitwise-equal losses) and SIGUSR1 saves and exits for requeue; also
with background saves (checkpoint.async_save), killed while one is being written."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_ext.checkpoint_index import check_complete
from megatron_ext.train import EXIT_REQUEUE
from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"


def train_cmd(out, data, *overrides):
    return [sys.executable, "-m", "megatron_ext.train", "--recipe", str(RECIPE), f"checkpoint.dir={out}",
            f"data.prefix={data}", "parallel.context=1", "train.seq_length=512",
            "train.global_batch_size=2", "train.lr=1e-2", *overrides]


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def wait_for(predicate, proc, timeout=300):
    start = time.time()
    while not predicate():
        if proc.poll() is not None:
            return False
        if time.time() - start > timeout:
            raise TimeoutError
        time.sleep(0.02)
    return True


def latest(out):
    f = out / "latest_checkpointed_iteration.txt"
    return int(f.read_text()) if f.exists() else None


@pytest.fixture(scope="module")
def straight(tmp_path_factory, token_data):
    """Six uninterrupted steps."""
    out = tmp_path_factory.mktemp("straight")
    subprocess.run(train_cmd(out, token_data, "train.steps=6"), check=True, env=env(), capture_output=True)
    return out


# `python -m megatron_ext.train` (through runpy) whose save of step 6 never starts: the test kills the run once the
# step-3 checkpoint is there, and steps 4-6 took 0.5 s, which a poll late on a loaded machine missed (the run had
# finished: "run finished before it could be killed"). Now the kill lands in steps 4-6 or at the held save.
HELD_TRAIN = """
import runpy, time

from megatron_ext import checkpoint

save = checkpoint.save_sharded_state


def held(root, iteration, *args, **kwargs):
    while iteration >= 6:
        time.sleep(1)
    return save(root, iteration, *args, **kwargs)


checkpoint.save_sharded_state = held
runpy.run_module("megatron_ext.train", run_name="__main__", alter_sys=True)
"""


def test_kill9_and_resume_matches_uninterrupted_run(tmp_path, token_data, straight):

    resumed, tensorboard = tmp_path / "resumed", f"checkpoint.tensorboard_dir={tmp_path / 'tb'}"
    cmd = train_cmd(resumed, token_data, "train.steps=6", "checkpoint.interval=3", tensorboard)
    assert cmd[1:3] == ["-m", "megatron_ext.train"]
    proc = subprocess.Popen([sys.executable, "-c", HELD_TRAIN, *cmd[3:]], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    killed = wait_for(lambda: latest(resumed) == 3, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert killed, "run finished before it could be killed; make steps slower"
    assert latest(resumed) == 3
    out = subprocess.run(train_cmd(resumed, token_data, "train.steps=6", "checkpoint.interval=3", tensorboard),
                         env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "at step 3 (sample 6, 3,072 tokens trained; " in out.stdout
    assert "[train] done: steps 4..6 in " in out.stdout and " 3,072 tokens " in out.stdout
    assert json.loads((resumed / "iter_0000006/megatron_ext.json").read_text())["data_samples"] == 12  # 6 x 2

    a, b = metrics(straight), metrics(resumed)
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [m["consumed_samples"] for m in b] == [2, 4, 6, 8, 10, 12]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bitwise on CPU
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]
    from tests.unit.test_train_metrics import _tensorboard_scalars

    scalars = _tensorboard_scalars(tmp_path / "tb")  # TensorBoard stores float32
    assert scalars["train/loss"] == [(m["step"], float(np.float32(m["loss"]))) for m in b]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/memory_gib"} <= set(scalars)


def test_negative_control_changed_update_after_resume_differs(tmp_path, token_data, straight):
    """The equality above can fail: resuming with another learning rate changes every later loss."""
    run = tmp_path / "run"
    subprocess.run(train_cmd(run, token_data, "train.steps=3"), check=True, env=env(), capture_output=True)
    subprocess.run(train_cmd(run, token_data, "train.steps=6", "train.lr=2e-2"), check=True, env=env(),
                   capture_output=True)
    a, b = metrics(straight), metrics(run)
    assert [m["loss"] for m in a[:4]] == [m["loss"] for m in b[:4]]  # step 4's forward uses the step-3 weights
    assert a[4]["loss"] != b[4]["loss"] and a[5]["loss"] != b[5]["loss"]


def test_metrics_lr_is_the_rate_each_step_used(tmp_path, token_data):
    """Warm-up from 0 over 2 steps (Megatron's scheduler: step 1 updates at the initial rate 0), then linear decay; the
    metrics said the next step's rate before ([5e-3, 1e-2, 0, 0] here)."""
    run = tmp_path / "run"
    schedule = ["train.warmup_steps=2", "train.lr_schedule=linear", "train.min_lr=0"]
    subprocess.run(train_cmd(run, token_data, "train.steps=3", *schedule), check=True, env=env(), capture_output=True)
    subprocess.run(train_cmd(run, token_data, "train.steps=4", *schedule), check=True, env=env(), capture_output=True)
    # 3 steps, then resumed to 4: the decay runs over train.steps, so step 4 is halfway down the 4-step curve
    assert [m["lr"] for m in metrics(run)] == pytest.approx([0.0, 5e-3, 1e-2, 5e-3])


def test_resume_takes_the_adam_settings_of_the_recipe(tmp_path, token_data, straight):
    """Loading the optimizer state brought back the saved run's betas and eps, so a changed train.adam_* had no
    effect: resumed with another eps, the losses after the resume's first update differ."""
    run = tmp_path / "run"
    subprocess.run(train_cmd(run, token_data, "train.steps=3"), check=True, env=env(), capture_output=True)
    subprocess.run(train_cmd(run, token_data, "train.steps=6", "train.adam_eps=0.1"), check=True, env=env(),
                   capture_output=True)
    a, b = metrics(straight), metrics(run)
    assert [m["loss"] for m in a[:4]] == [m["loss"] for m in b[:4]]
    assert a[4]["loss"] != b[4]["loss"] and a[5]["loss"] != b[5]["loss"]


@pytest.mark.parametrize("save", ["in-place", "background"])
def test_signal_to_every_process_after_an_earlier_save(tmp_path, token_data, save):
    """SIGUSR1 saves and exits for requeue. Slurm sends its USR1 (and its TERM) to every process of the step: also
    to the result-queue server that Megatron's checkpoint writer spawns at the first save. That server died of it
    and the save on the signal failed with BrokenPipeError (exit 1, no requeue) in any run that had saved before
    (seen by hand)."""
    out = tmp_path / "run"
    cmd = train_cmd(out, token_data, "train.steps=1000", "checkpoint.interval=2",
                    f"checkpoint.async_save={save == 'background'}")
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert wait_for(lambda: (latest(out) or 0) >= 2 and len(metrics(out)) >= 3, proc)
    os.killpg(proc.pid, signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_REQUEUE, stderr[-3000:]
    last = metrics(out)[-1]["step"]
    assert latest(out) == last and "received SIGUSR1; checkpoint saved" in stdout
    check_complete(out / f"iter_{last:07d}")


def weights_far_from(a, b) -> list[str]:
    """Names of the weights of checkpoints `a` and `b` (iteration folders) that differ by more than bf16's rounding."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    x, y = load_plain_tensors(str(a)), load_plain_tensors(str(b))
    names = [k for k in x if not k.startswith("optimizer") and "_extra_state" not in k and hasattr(x[k], "dtype")]
    assert names and set(names) <= set(y)
    return [k for k in names if not ((x[k].float() - y[k].float()).abs() <= 2**-8 * y[k].float().abs() + 1e-6).all()]


def test_resume_in_another_precision_starts_a_fresh_optimizer_state(tmp_path, token_data, straight,
                                                                  cpu_parallel_state):
    """The optimizer state is keyed by the parameters' dtype: fp32 -> bf16 failed with a KeyError traceback. Then the
    first step (at a learning rate too small to move a bf16 weight) wrote back the bf16 optimizer's fp32 copies of
    the weights, made when it was built: the random initial ones, not the checkpoint's."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    out = subprocess.run(train_cmd(run, token_data, "train.steps=7", "train.precision=bf16", "train.lr=1e-9"),
                         env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed weights from" in out.stdout and "train.precision was fp32, now bf16" in out.stdout
    assert latest(run) == 7
    assert weights_far_from(run / "iter_0000007", straight / "iter_0000006") == []


def test_init_from_in_bf16_trains_the_loaded_weights(tmp_path, token_data, straight, cpu_parallel_state):
    """Every paper stage starts from checkpoint.init_from in bf16: its first step put the random initial weights
    back (the bf16 optimizer's fp32 copies), silently, from step 2 on training a random model."""
    out = subprocess.run(train_cmd(tmp_path / "run", token_data, f"checkpoint.init_from={straight}", "train.steps=2",
                                   "train.precision=bf16", "train.lr=1e-9"), env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert weights_far_from(tmp_path / "run/iter_0000002", straight / "iter_0000006") == []
    first, second = (m["loss"] for m in metrics(tmp_path / "run"))
    assert abs(second - first) < 0.05 * first, (first, second)  # the same weights, the next batch


def test_finished_run_started_again_trains_nothing(tmp_path, token_data, straight):
    """A requeue or rerun of a finished run exits 0 at once, saying so, and leaves its checkpoint alone; resumed as
    another model, it stops with one line."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = (run / "metrics.jsonl").read_text()
    out = subprocess.run(train_cmd(run, token_data, "train.steps=6"), env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "is at step 6 and train.steps = 6: nothing to train" in out.stdout
    assert (run / "metrics.jsonl").read_text() == before and latest(run) == 6
    # resumed with tied output weights: one line before the load (it failed there on the distributed optimizer's
    # buffer shape, a CheckpointingException traceback); launch --check has its own test (test_checkpoint_cli)
    out = subprocess.run(train_cmd(run, token_data, "train.steps=7", "model.tie_word_embeddings=true"), env=env(),
                         capture_output=True, text=True)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors == [f"error: checkpoint.dir = '{run}' holds another model (tie_word_embeddings: False -> True): use "
                      "the checkpoint's model.* settings, or a new checkpoint.dir (with checkpoint.init_from for a new "
                      "stage)"], errors
    assert latest(run) == 6


def test_checkpoint_dir_of_another_stage_is_refused(tmp_path, token_data, sft_data, straight):
    """An SFT recipe given the CPT run's folder as checkpoint.dir stops with one line naming the fix, whether the
    CPT is finished at the SFT's train.steps (it exited 0 having trained nothing) or not (it went on with the CPT's
    optimizer state and step count as SFT, init_from unread). Control: without the refusal, exit 0 both times."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = (run / "metrics.jsonl").read_text()
    for steps in (6, 8):
        out = subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(ROOT / "recipes/tiny/sft.yaml"),
                              f"checkpoint.dir={run}", f"checkpoint.init_from={run}", f"data.prefix={sft_data}",
                              f"train.steps={steps}"], env=env(), capture_output=True, text=True)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert errors == [f"error: checkpoint.dir = '{run}' holds a cpt run (recipe 'cpt', step 6); this recipe is "
                          f"stage sft: give a new checkpoint.dir (checkpoint.init_from={run} loads its weights)"], errors
    assert (run / "metrics.jsonl").read_text() == before and latest(run) == 6


def test_kill9_while_saving_in_background_then_resume_is_exact(tmp_path, token_data, straight):
    """A save every step, so that one is most likely being written when the run is killed (its temporary folder
    then stays behind, and the pointer on the save before)."""
    run = tmp_path / "run"
    cmd = train_cmd(run, token_data, "train.steps=6", "checkpoint.interval=1", "checkpoint.async_save=true")
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    killed = wait_for(lambda: (latest(run) or 0) >= 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert killed, "run finished before it could be killed; make steps slower"
    step = latest(run)
    check_complete(run / f"iter_{step:07d}")  # the pointer never names a folder being written
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"at step {step}" in out.stdout and latest(run) == 6
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # the killed save's folder: written again
    a, b = metrics(straight), metrics(run)
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [m["consumed_samples"] for m in b] == [2, 4, 6, 8, 10, 12]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bitwise on CPU
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]


def test_every_rank_resumes_the_iteration_rank_0_reads(tmp_path, torchrun):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank0/latest_checkpointed_iteration.txt").write_text("5")
    out = torchrun(ROOT / "tests/distributed/workers/latest_agreed.py", 2, str(tmp_path))
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0 agreed 5", "rank 0 error True", "rank 1 agreed 5", "rank 1 error True"], out


def test_bf16_resume_on_two_ranks_matches_uninterrupted_run(tmp_path, token_data, torchrun):
    """The paper's precision, with the distributed optimizer's fp32 copies of the weights sharded over DP 2: a run
    stopped after step 2 and resumed goes on from those copies (not from the bf16 weights), as if never stopped."""
    args = ["--recipe", str(RECIPE), f"data.prefix={token_data}", "parallel.context=1", "train.seq_length=256",
            "train.global_batch_size=4", "train.precision=bf16", "train.lr=1e-2"]
    torchrun("megatron_ext.train", 2, *args, f"checkpoint.dir={tmp_path / 'straight'}", "train.steps=4",
             module=True)
    torchrun("megatron_ext.train", 2, *args, f"checkpoint.dir={tmp_path / 'resumed'}", "train.steps=2",
             module=True)
    out = torchrun("megatron_ext.train", 2, *args, f"checkpoint.dir={tmp_path / 'resumed'}", "train.steps=4",
                   module=True)
    assert "resumed from" in out and "at step 2" in out
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bitwise on CPU
