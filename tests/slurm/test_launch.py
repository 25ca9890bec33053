"""megatron_ext.launch: --dry-run text, stage planning, errors, and through submitit on the local Slurm
cluster the CPT -> SFT -> NIAH chain and a USR1 requeue."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from megatron_ext.launch import check, parse_time, plan_stages
from megatron_ext.recipe import RecipeError
from tests.conftest import ROOT
from tests.slurm.conftest import TINY_OVERRIDES, RequeueNow, cluster_busy, job_env, metrics, wait_job

EXPECTED = ROOT / "tests/slurm/expected/launch_dry_run.txt"
DRY_RUN_ARGS = ["--recipe", "recipes/cpt_1m.yaml", "--stages", "cpt_1m,sft", "--partition", "batch",
                "--account", "proj", "--time", "1-00:00:00", "--dry-run", "sft:train.steps=100", "train.seed=7"]


def launch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ext.launch", *args], capture_output=True, text=True,
                          cwd=ROOT, env=job_env(), timeout=timeout)


def test_dry_run_matches_expected_text():
    proc = launch(*DRY_RUN_ARGS)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == EXPECTED.read_text()


def test_dry_run_reflects_its_arguments():
    """Negative control for the comparison: other arguments print other text."""
    proc = launch(*[a if a != "batch" else "debug" for a in DRY_RUN_ARGS])
    assert proc.returncode == 0 and proc.stdout != EXPECTED.read_text()
    assert "sbatch partition: debug" in proc.stdout
    # overrides also as --set (tools/plan.py's and `recipe check`'s form): the same plan
    as_set = [a for a in DRY_RUN_ARGS if a not in ("sft:train.steps=100", "train.seed=7")]
    proc = launch(*as_set, "--set", "sft:train.steps=100", "--set", "train.seed=7")
    assert proc.returncode == 0 and proc.stdout == EXPECTED.read_text(), proc.stderr


def test_dry_run_niah_job_after_the_last_stage():
    proc = launch("--recipe", "recipes/cpt_1m.yaml", "--stages", "cpt_1m,sft", "--niah", "128K:1M:4", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    niah = proc.stdout.split("then niah: ")[1]
    assert niah.startswith("32 processes, after stage 2")  # cpt_1m's TP 8 x CP 4
    assert "sbatch nodes: 4\n" in niah and "sbatch ntasks_per_node: 8\n" in niah
    assert "dependency': 'afterok:<job of stage 2>'" in niah and "'requeue': True" in niah
    assert "sbatch signal_delay_s: 300\n" in niah  # slurm/niah.sh's USR1 warning: the evaluation requeues with --resume
    assert ("run per task: python tools/niah.py --megatron checkpoints/sft_1m --engine megatron --tp 8 --cp 4 "
            "--lengths 128K:1M:4 --depths 0:100:10 --out checkpoints/sft_1m_niah --no-progress --chat") in niah
    bad = launch("--recipe", "recipes/cpt_1m.yaml", "--niah", "1Q", "--dry-run")
    assert bad.returncode == 1 and bad.stderr.startswith("error: --niah '1Q': '1Q' is not a token count")
    # beyond the last stage's context: the evaluation job would fail (or skip it) after the training
    bad = launch("--recipe", "recipes/cpt_1m.yaml", "--stages", "cpt_1m,sft", "--niah", "128K:2M:5", "--dry-run")
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "error: --niah '128K:2M:5': 2,097,152 tokens is beyond the last stage's model.max_position_embeddings = "
        "1,048,576 (sft); evaluate at most that")


def test_dry_run_ruler_job_after_the_last_stage_too():
    proc = launch("--recipe", "recipes/cpt_1m.yaml", "--stages", "cpt_1m,sft", "--niah", "1M", "--ruler", "128K,1M",
                  "--dry-run")
    assert proc.returncode == 0, proc.stderr
    ruler = proc.stdout.split("then ruler: ")[1]
    # after the last training stage, not after NIAH: a failed NIAH does not cancel it
    assert ruler.startswith("32 processes, after stage 2") and "dependency': 'afterok:<job of stage 2>'" in ruler
    assert "sbatch job_name: ruler\n" in ruler and "sbatch nodes: 4\n" in ruler
    assert "sbatch signal_delay_s: 300\n" in ruler  # slurm/niah.sh's, which runs RULER too
    assert ("run per task: python tools/niah.py ruler --megatron checkpoints/sft_1m --engine megatron --tp 8 --cp 4 "
            "--lengths 128K,1M --tasks all --out checkpoints/sft_1m_ruler --no-progress --chat") in ruler
    alone = launch("--recipe", "recipes/cpt_1m.yaml", "--ruler", "128K", "--dry-run")
    assert "then ruler: 32 processes, after stage 1" in alone.stdout and "then niah" not in alone.stdout
    assert "--out checkpoints/cpt_1m_ruler --no-progress\n" in alone.stdout  # no --chat after a CPT stage
    bad = launch("--recipe", "recipes/cpt_1m.yaml", "--ruler", "1Q", "--dry-run")
    assert bad.returncode == 1 and bad.stderr.startswith("error: --ruler '1Q': '1Q' is not a token count")


def test_plan_stages_and_stage_overrides():
    plan = plan_stages("recipes/tiny/cpt.yaml", "cpt,sft", ["a.b=1", "sft:c.d=2"])
    assert [(s.name, s.recipe, s.overrides) for s in plan] == [
        ("cpt", "recipes/tiny/cpt.yaml", ["a.b=1"]), ("sft", "recipes/tiny/sft.yaml", ["a.b=1", "c.d=2"])]
    assert [s.recipe for s in plan_stages("recipes/cpt_4m.yaml", None, [])] == ["recipes/cpt_4m.yaml"]
    with pytest.raises(RecipeError, match="no stage named 'cpt2'"):
        plan_stages("recipes/tiny/cpt.yaml", "cpt,sft", ["cpt2:train.steps=1"])


def test_parse_time():
    assert [parse_time(t) for t in ("30", "04:00:00", "1-00:00:00", "10:30", "1-02", "00:00:01")] == \
           [30, 240, 1440, 11, 1560, 1]
    with pytest.raises(RecipeError, match="--time"):
        parse_time("4h")


@pytest.mark.parametrize("args, message", [
    (["--recipe", "recipes/nope.yaml", "--dry-run"], "recipes/nope.yaml"),
    (["--recipe", "recipes/cpt_4m.yaml", "--nodes", "3", "--dry-run"], "does not divide cluster.nodes x cluster.gpus_per_node = 24"),
    (["--recipe", "recipes/cpt_4m.yaml", "--dry-run", "train.bogus=1"], "bogus"),
])
def test_launch_bad_input_one_line(args, message):
    proc = launch(*args)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ")


def test_check_gpus_per_node():
    with pytest.raises(RecipeError, match="8 tasks per node but 4 GPUs per node"):
        check(str(ROOT / "recipes/cpt_4m.yaml"), [], 256, tasks_per_node=8, gpus_per_node=4, paths=False)
    check(str(ROOT / "recipes/cpt_4m.yaml"), [], 256, tasks_per_node=8, gpus_per_node=8, paths=False)


def test_submitit_chain_cpt_then_sft(slurm_cluster, tmp_path, token_data, sft_data, toy_tokenizer):
    """Two stages through submitit with afterok: tiny CPT, then tiny SFT from its checkpoint, then NIAH of the
    SFT checkpoint on the Megatron engine at the CPT's CP 2."""
    cpt, sft = tmp_path / "cpt", tmp_path / "sft"
    args = ["--recipe", "recipes/tiny/cpt.yaml", "--stages", "cpt,sft", "--nodes", "2", "--gpus-per-node", "1",
            "--cpus-per-task", "1", "--time", "30", "--folder", str(tmp_path / "submitit/%j"), "--wait",
            *TINY_OVERRIDES, "train.steps=3", f"cpt:data.prefix={token_data}", f"sft:data.prefix={sft_data}",
            f"cpt:checkpoint.dir={cpt}", f"sft:checkpoint.dir={sft}", f"sft:checkpoint.init_from={cpt}",
            "sft:train.global_batch_size=2", "sft:train.lr=1e-3", f"model.tokenizer={toy_tokenizer}",
            "--niah", "256"]
    with RequeueNow():
        proc = launch(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith(("submitted", "done"))] == \
           ["submitted cpt", "submitted sft", "submitted niah", "done cpt", "done sft", "done niah"]
    a, b = metrics(cpt), metrics(sft)
    assert [m["step"] for m in a] == [1, 2, 3] and [m["step"] for m in b] == [1, 2, 3]
    logs = "".join(p.read_text() for p in tmp_path.glob("submitit/*/*_0_log.out"))
    assert f"initialised weights from {cpt}" in logs  # stage 2 starts from stage 1's checkpoint
    assert "[train] cpt: cpt seq 256" in logs and "[train] sft: sft seq 256" in logs
    assert all(m["loss_tokens"] < 2 * 256 for m in b)  # SFT: loss on assistant tokens only
    niah = json.loads((tmp_path / "sft_niah/results.json").read_text())
    assert niah["settings"]["engine"] == "megatron" and niah["settings"]["layout"]["context"] == 2
    assert niah["settings"]["chat"] and niah["lengths"] == [256] and len(niah["cells"]) == 11
    # afterok: stage 2 started only once stage 1 had completed.
    jobs = [line.split("job ")[1].split()[0].rstrip(":") for line in lines if line.startswith("submitted")][:2]
    acct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(jobs), "-o", "JobID,State,Start,End"],
                          capture_output=True, text=True).stdout.split()
    rows = {row.split("|")[0]: row.split("|")[1:] for row in acct}
    # (the last job may still be finishing: submitit's result file comes before Slurm's end)
    assert rows[jobs[0]][0] == "COMPLETED" and rows[jobs[1]][0] in ("RUNNING", "COMPLETING", "COMPLETED"), acct
    assert rows[jobs[1]][1] >= rows[jobs[0]][2], acct  # ISO times compare as strings


def test_failed_stage_cancels_the_later_ones(slurm_cluster, tmp_path, token_data, sft_data):
    """Submitted without --wait (nothing watches the chain): the CPT stage diverges (lr 1e30: exit 4, the job
    fails) and Slurm itself cancels the SFT job after it (--kill-on-invalid-dep). Without that flag the SFT job
    stayed pending forever (Reason DependencyNeverSatisfied; seen by hand on this cluster)."""
    args = ["--recipe", "recipes/tiny/cpt.yaml", "--stages", "cpt,sft", "--nodes", "2", "--gpus-per-node", "1",
            "--cpus-per-task", "1", "--time", "30", "--folder", str(tmp_path / "submitit/%j"), *TINY_OVERRIDES,
            "train.steps=3", f"cpt:data.prefix={token_data}", f"sft:data.prefix={sft_data}", "cpt:train.lr=1e30",
            f"cpt:checkpoint.dir={tmp_path / 'cpt'}", f"sft:checkpoint.dir={tmp_path / 'sft'}",
            f"sft:checkpoint.init_from={tmp_path / 'cpt'}", "sft:train.global_batch_size=2"]
    proc = launch(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpt, sft = [line.split("job ")[1].split()[0] for line in proc.stdout.splitlines() if line.startswith("submitted")]
    assert wait_job(cpt)[0] == "FAILED"
    assert wait_job(sft, timeout=120)[0] == "CANCELLED"
    logs = "".join(p.read_text() for p in tmp_path.glob("submitit/*/*_0_log.err"))
    assert "training diverged; stopped without saving" in logs, logs[-3000:]


def chain_args(tmp_path, token_data, sft_data) -> list[str]:
    """The tiny CPT -> SFT chain on 2 "nodes" of the local cluster (test_failed_stage_cancels_the_later_ones')."""
    return ["--recipe", "recipes/tiny/cpt.yaml", "--stages", "cpt,sft", "--nodes", "2", "--gpus-per-node", "1",
            "--cpus-per-task", "1", "--time", "30", *TINY_OVERRIDES, "train.steps=3", f"cpt:data.prefix={token_data}",
            f"sft:data.prefix={sft_data}", f"cpt:checkpoint.dir={tmp_path / 'cpt'}",
            f"sft:checkpoint.dir={tmp_path / 'sft'}", f"sft:checkpoint.init_from={tmp_path / 'cpt'}",
            "sft:train.global_batch_size=2"]


def test_a_refused_sbatch_says_what_was_submitted(slurm_cluster, tmp_path, token_data, sft_data):
    """sbatch refusing a job ended the launcher in submitit's ~30-line FailedJobError traceback, and one refused
    after the first stage left that stage's job queued without a word. Now one line in slurm/pipeline.sh's words. On
    the local cluster: the first job refused (no such partition); then the SFT job's GPU (the cluster has none) after
    the CPT job, kept waiting (cluster_busy) and cancelled. The refused job's files (submitit's pickle and sbatch
    script, under a uuid, piling up with each retry) are removed; another launch's in the same folder are not."""
    args = [*chain_args(tmp_path, token_data, sft_data), "--folder", str(tmp_path / "submitit/%j")]
    proc = launch(*args, "--partition", "nosuch")
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: sbatch refused the cpt job (invalid partition specified: nosuch; Batch job submission failed: Invalid "
        "partition name specified); nothing launched"]
    assert not (tmp_path / "submitit").exists()  # submitit's pickle and sbatch script of the refused job: removed
    # another launch's files in the shared folder, between its sbatch and its renames: not the refused job's to remove
    others = {f"{'a' * 32}.pkl", f".submission_file_{'b' * 32}.sh"}
    (tmp_path / "submitit").mkdir()
    for name in others:
        (tmp_path / "submitit" / name).write_bytes(b"another launch's")
    with cluster_busy():  # the CPT job waits in the queue, not run
        proc = subprocess.run([sys.executable, "-m", "megatron_ext.launch", *args, "sft:runtime.device=cuda"],
                              capture_output=True, text=True, cwd=ROOT, env=job_env(), timeout=600)
        cpt = [line.split()[3] for line in proc.stdout.splitlines() if line.startswith("submitted cpt: job ")]
        try:
            assert proc.returncode == 1 and len(cpt) == 1, proc.stdout + proc.stderr[-3000:]
            assert proc.stderr.splitlines() == [
                "error: sbatch refused the sft job (Invalid generic resource (gres) specification); submitted before "
                f"it: cpt (job {cpt[0]}), which Slurm runs as submitted: scancel {cpt[0]} to cancel them"], proc.stderr
            queued = subprocess.run(["squeue", "-h", "-j", cpt[0], "-o", "%T"], capture_output=True, text=True).stdout
            assert queued.strip() == "PENDING", queued  # what the line says: the CPT job is in the queue
            # the CPT job's folder and the link to its script stay; the refused SFT job's pickle and script do not
            left = {p.name for p in (tmp_path / "submitit").iterdir() if not p.is_symlink()}
            assert left == {cpt[0], *others}, left
        finally:
            for job in cpt:
                subprocess.run(["scancel", job], check=False)


@pytest.mark.parametrize("folder, said", [
    ("file", "--folder {tmp}/file: is a file, not a folder"),
    ("file/logs/%j", "--folder {tmp}/file/logs/%j: lies under {tmp}/file, which is a file, not a folder"),
])
def test_a_folder_that_is_a_file_is_refused_before_submitting(tmp_path, token_data, sft_data, folder, said):
    """--folder a file (or below one) ended in a FileExistsError / NotADirectoryError traceback from submitit's
    mkdir; now one line naming --folder, before any sbatch (no cluster needed: none is reached)."""
    (tmp_path / "file").write_text("")
    proc = launch(*chain_args(tmp_path, token_data, sft_data), "--folder", str(tmp_path / folder))
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: {said.format(tmp=tmp_path)}; give a folder for submitit's logs and pickles"]


def test_submitit_usr1_requeues_and_resumes(slurm_cluster, tmp_path, token_data, toy_tokenizer):
    """submitit path: USR1 to the tasks -> the trainer saves -> rank 0 requeues -> the rerun resumes. Then the NIAH
    job after it: USR1 -> submitit requeues it with --resume -> the rerun keeps the saved cells and runs the rest."""
    run = tmp_path / "run"
    # The signal must land before the job ends on its own: a step takes ~40 ms here, and squeue + scancel + slurmd's
    # delivery took longer than the last 22 steps of a 24-step run once under load (the job finished unsignalled).
    # 64 steps leave 2.5 s; the job id is looked up before the wait, so only scancel stands between.
    steps = 64
    args = ["--recipe", "recipes/tiny/cpt.yaml", "--nodes", "2", "--gpus-per-node", "1", "--cpus-per-task", "1",
            "--time", "30", "--folder", str(tmp_path / "submitit/%j"), "--wait", f"data.prefix={token_data}",
            *TINY_OVERRIDES, f"train.steps={steps}", f"checkpoint.dir={run}", f"model.tokenizer={toy_tokenizer}",
            "--niah", "256,512,1024,2048"]

    def usr1_once(name: str, ready) -> str:
        deadline, job = time.time() + 300, None
        while job is None or not ready():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            if job is None:
                job = (subprocess.run(["squeue", "-h", "-o", "%i", "-n", name], capture_output=True,
                                      text=True).stdout.split() or [None])[0]
            time.sleep(0.05)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)  # what --signal=USR1@T does
        return job

    with RequeueNow() as requeue:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_ext.launch", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env=job_env())
        job = usr1_once("cpt", lambda: len(metrics(run)) >= 2)
        niah_job = usr1_once("niah", lambda: (tmp_path / "run_niah/results.json").is_file())
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    logs = "".join(p.read_text() for p in tmp_path.glob("submitit/*/*_0_log.out"))
    assert job in requeue.released and niah_job in requeue.released, (requeue.released, logs[-3000:])
    assert f"requeueing job {job}" in logs and "resumed from" in logs, logs[-3000:]
    assert [m["step"] for m in metrics(run)] == list(range(1, steps + 1))
    kept = [line for line in logs.splitlines() if " of 44 cells kept from the earlier run" in line]
    assert len(kept) == 1 and 11 <= int(kept[0].split("[niah] ")[1].split()[0]) < 44, logs[-3000:]
    niah = json.loads((tmp_path / "run_niah/results.json").read_text())
    assert len(niah["cells"]) == 44 and all(c["score"] is not None for c in niah["cells"])
    assert "done niah" in stdout
