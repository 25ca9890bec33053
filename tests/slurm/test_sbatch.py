"""sbatch slurm/*.sh on the local 2-node Slurm cluster: same losses as torchrun, preemption and requeue
resume exactly, bad input fails before srun."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from megatron_ext.train import EXIT_REQUEUE
from tests.conftest import ROOT
from tests.slurm.conftest import (NODES, SBATCH_SIZE, TASKS_PER_NODE, TINY, TINY_OVERRIDES, RequeueNow, job_env,
                                  metrics, sbatch, wait_job)

STEPS = 40  # long enough that a USR1 sent after the step-4 save lands mid-run under load (24 left ~2 s), short enough


def overrides(run_dir, data, steps=STEPS):
    return [f"checkpoint.dir={run_dir}", f"data.prefix={data}", f"train.steps={steps}", *TINY_OVERRIDES]


def squeue_state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def losses(ms):
    return [m["loss"] for m in ms]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory, torchrun, token_data):
    """The reference: the same recipe and overrides under torchrun on this machine."""
    out = tmp_path_factory.mktemp("torchrun")
    torchrun("megatron_ext.train", NODES * TASKS_PER_NODE, "--recipe", str(TINY), *overrides(out, token_data),
             module=True, launcher="torchrun")
    return metrics(out)


@pytest.fixture(scope="module")
def sbatch_run(slurm_cluster, tmp_path_factory, token_data):
    tmp = tmp_path_factory.mktemp("sbatch")
    started = time.time()
    proc = sbatch("cpt_4m.sh", *overrides(tmp / "run", token_data), out=tmp / "job.log",
                  env=job_env(RECIPE=str(TINY)))
    return proc, (tmp / "job.log").read_text(), metrics(tmp / "run"), time.time() - started


def test_sbatch_cpt_4m_matches_torchrun(sbatch_run, torchrun_run):
    proc, log, ms, seconds = sbatch_run
    assert proc.returncode == 0, log[-4000:]
    assert f"tasks {NODES * TASKS_PER_NODE}" in log and "nodes node[1-2] (2)" in log
    assert "git " in log and f"recipe {TINY}" in log
    assert [m["step"] for m in ms] == list(range(1, STEPS + 1))
    assert losses(ms)[0] > 5.0  # untrained: about ln(vocab)
    # Same processes, same layout, same data order: bitwise equal on CPU.
    assert losses(ms) == losses(torchrun_run)
    assert [m["grad_norm"] for m in ms] == [m["grad_norm"] for m in torchrun_run]


def test_usr1_saves_requeues_and_resumes_exactly(slurm_cluster, tmp_path, token_data, torchrun_run):
    run = tmp_path / "run"
    log = tmp_path / "job.log"
    with RequeueNow() as requeue:
        # a save before the signal: common.sh passes the USR1 on to every process of the step, also to the result
        # queue server Megatron's checkpoint writer starts at the first save (it died of it before the fix)
        cmd = ["sbatch", "--parsable", *SBATCH_SIZE, f"--output={log}", str(ROOT / "slurm/cpt_4m.sh"),
               *overrides(run, token_data), "checkpoint.interval=4"]
        job_id = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                                env=job_env(RECIPE=str(TINY))).stdout.strip().split(";")[0]
        deadline = time.time() + 300
        while not (run / "iter_0000004").is_dir():  # training is under way, a checkpoint saved
            assert squeue_state(job_id), f"job ended early:\n{log.read_text()[-3000:] if log.exists() else ''}"
            assert time.time() < deadline
            time.sleep(0.05)
        # What Slurm does at --signal=B:USR1@600 before the time limit: USR1 to the batch shell only.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        state, exit_code = wait_job(job_id)
    text = log.read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), text[-4000:]
    assert "received USR1" in text and f"training exited with {EXIT_REQUEUE}" in text, text[-3000:]
    assert f"requeueing job {job_id} (restart 1)" in text
    assert f"job {job_id} (cpt_4m) restart 1" in text  # the same job ran again (--open-mode=append kept the log)
    assert job_id in requeue.released
    resumed = int(text.split("resumed from")[1].split("at step ")[1].split()[0])
    assert 4 <= resumed < STEPS, f"USR1 arrived after the run finished (step {resumed}); make it longer"
    ms = metrics(run)
    assert [m["step"] for m in ms] == list(range(1, STEPS + 1))
    assert losses(ms) == losses(torchrun_run)  # final losses equal an uninterrupted run, bitwise


def test_scancel_stays_cancelled_and_a_second_job_cannot_share_the_folder(slurm_cluster, tmp_path, token_data):
    """Two findings of a user audit, on the real cluster: the same stage submitted twice trained into one
    checkpoint.dir at once (one job died mid-save, metrics.jsonl held both runs' steps), and `scancel` of a running
    job came back by itself (the trainer saves on TERM and exits 3, and the script requeued it)."""
    run = tmp_path / "run"
    one_node = ["--nodes=1", f"--ntasks-per-node={NODES * TASKS_PER_NODE}", "--gpus-per-node=0",
                "--cpus-per-task=1", "--time=30"]

    def submit(log: Path) -> str:
        cmd = ["sbatch", "--parsable", *one_node, f"--output={log}", str(ROOT / "slurm/cpt_4m.sh"),
               *overrides(run, token_data, steps=1000), "checkpoint.interval=4"]  # still running when cancelled
        return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                              env=job_env(RECIPE=str(TINY))).stdout.strip().split(";")[0]

    first = submit(tmp_path / "first.log")
    deadline = time.time() + 300
    while not (run / "iter_0000004").is_dir():  # training under way
        assert squeue_state(first), (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    second = submit(tmp_path / "second.log")
    assert wait_job(second, timeout=120)[0] == "FAILED"
    text = (tmp_path / "second.log").read_text()
    assert f"is being written by Slurm job {first} (RUNNING)" in text and "[train]" not in text, text[-3000:]
    subprocess.run(["scancel", first], check=True)
    state, _ = wait_job(first, timeout=90)  # a requeued job would be pending again, not settle
    text = (tmp_path / "first.log").read_text()
    assert state == "CANCELLED", text[-3000:]
    # (the log's last line, "job cancelled (scancel): not requeued", is there unless Slurm's kill of the batch
    # shell comes first)
    assert "requeueing" not in text and "restart 1" not in text, text[-3000:]
    assert (run / "latest_checkpointed_iteration.txt").is_file()  # it saved on the way out


def test_usr2_saves_and_stops_without_a_requeue(slurm_cluster, tmp_path, token_data):
    """`scancel --batch --signal=USR2`: stop a run now with a save (scancel's TERM is followed by KILL after
    KillWait, which a long-context step rarely fits); the job is not requeued and its checkpoint is the stop step."""
    run, log = tmp_path / "run", tmp_path / "job.log"
    cmd = ["sbatch", "--parsable", *SBATCH_SIZE, f"--output={log}", str(ROOT / "slurm/cpt_4m.sh"),
           *overrides(run, token_data, steps=1000), "checkpoint.interval=4"]
    job_id = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                            env=job_env(RECIPE=str(TINY))).stdout.strip().split(";")[0]
    # the next stage of a chain (slurm/pipeline.sh, launch --stages) waits for this one to succeed
    later = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=1", f"--dependency=afterok:{job_id}",
                            "--kill-on-invalid-dep=yes", f"--output={tmp_path / 'later.log'}", "--wrap=true"],
                           check=True, capture_output=True, text=True).stdout.strip().split(";")[0]
    deadline = time.time() + 300
    while not (run / "iter_0000004").is_dir():  # training under way
        assert squeue_state(job_id), log.read_text()[-3000:] if log.exists() else ""
        assert time.time() < deadline
        time.sleep(0.05)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True)
    state, exit_code = wait_job(job_id, timeout=120)
    text = log.read_text()
    assert (state, exit_code) == ("FAILED", f"{EXIT_REQUEUE}:0"), text[-3000:]
    assert "stopped on request (USR2): checkpoint saved; not requeued" in text, text[-3000:]
    # a stopped stage is not a successful one: the log says that Slurm cancels the chain's next stage
    assert f"job(s) {later} wait for this one to succeed (afterok) and are cancelled by Slurm" in text, text[-3000:]
    assert wait_job(later, timeout=60)[0] == "CANCELLED"
    assert "requeueing" not in text and "restart 1" not in text
    saved = int((run / "latest_checkpointed_iteration.txt").read_text())
    assert saved == metrics(run)[-1]["step"] >= 4  # the step it stopped at, saved


@pytest.mark.parametrize("what, env_extra, args, message", [
    ("missing recipe", {"RECIPE": "recipes/nope.yaml"}, [], "recipe recipes/nope.yaml not found"),
    ("unknown key", {}, ["train.bogus=1"], "bogus"),
    ("world size", {}, ["parallel.context=3"], "does not divide the world size = 2"),
    ("gpu count", {}, ["runtime.device=cuda"], "1 tasks per node but 0 GPUs per node allocated"),
    ("no pyxis", {"CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:25.01-py3"}, [], "pyxis is not installed"),
])
def test_bad_input_fails_before_srun(slurm_cluster, tmp_path, token_data, what, env_extra, args, message):
    env = job_env(**{"RECIPE": str(TINY), **env_extra})
    over = overrides(tmp_path / "run", token_data, steps=2) + args  # later overrides win
    started = time.time()
    proc = sbatch("cpt_4m.sh", *over, out=tmp_path / "job.log", env=env)
    text = (tmp_path / "job.log").read_text()
    assert proc.returncode == 1, text
    # one line per mistake: the check's own, saying that nothing was launched (before: then 'recipe check failed')
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], text
    assert errors[0].endswith("; nothing launched"), text
    assert "[train]" not in text and "srun: " not in text and not (tmp_path / "run").exists()
    assert time.time() - started < 60


def test_preflight_accepts_good_input(slurm_cluster, sbatch_run):
    """Negative control for the bad-input checks: the same preflight lets a good job through."""
    _, log, _, _ = sbatch_run
    assert "ok: cpt: cpt TP1 PP1 CP2 DP1 on 2 processes (cpu)" in log


def test_scripts_exist_for_every_stage():
    for stage in ("cpt_1m", "cpt_2m", "cpt_4m", "sft"):
        text = (ROOT / "slurm" / f"{stage}.sh").read_text()
        assert f"stage_main {stage} " in text and (ROOT / "recipes" / f"{stage}.yaml").is_file()
        for header in ("--nodes=32", "--gpus-per-node=8", "--exclusive", "--signal=B:USR1@", "--requeue",
                       "--open-mode=append"):
            assert f"#SBATCH {header}" in text, (stage, header)
