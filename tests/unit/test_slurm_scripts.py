"""slurm/common.sh's decision after the tasks end, run for real in bash with srun, squeue, sacct, scontrol and
scancel replaced by stubs, for the cases the local cluster cannot show in seconds (a time-limit or preemption
TERM, an early time-limit warning): a job its user cancels stays cancelled (on the real cluster too:
tests/slurm/test_sbatch.py), a time-limit warning at start does not requeue in a loop, and the script finds the
project when submitted from another folder."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

STUBS = {
    # the training step: optionally signal the batch shell (as Slurm does), then end with FAKE_RC
    # FAKE_CONTAINER_PATH: the preflight's check (megatron_ext.launch) runs for real, with this PATH (a container
    # without Slurm's commands), and a failed one gets srun's own line; each such call's arguments, one line, go to
    # FAKE_CHECKS
    "srun": '[[ $1 == --help ]] && { echo "${FAKE_HELP:-}"; exit 0; }\n'
            'if [[ -n ${FAKE_CONTAINER_PATH:-} && " $* " == *" megatron_ext.launch "* ]]; then\n'
            '  while [[ $1 == -* ]]; do shift; done; echo "$*" >>"$FAKE_CHECKS"; exec 4>&2; rc=0\n'
            # a program the container lacks: what Slurm 22.05's slurmstepd and srun print (seen on tests/slurm's cluster)
            '  if ! (PATH=$FAKE_CONTAINER_PATH; command -v "$1" >/dev/null); then\n'
            '    echo "slurmstepd-node1: error: execve(): $1: No such file or directory" >&2\n'
            '    echo "srun: error: node1: task 0: Exited with exit code 2" >&2; exit 2\n  fi\n'
            '  { PATH=$FAKE_CONTAINER_PATH "$@" 2>&4; } 2>/dev/null || rc=$?\n'
            '  if ((rc > 128)); then echo "srun: error: node1: task 0: Killed" >&2\n'
            '  elif ((rc)); then echo "srun: error: node1: task 0: Exited with exit code $rc" >&2; fi; exit $rc\nfi\n'
            '[[ -n ${FAKE_ARGV:-} ]] && printf "%s\\n" "$@" >"$FAKE_ARGV"\n[[ -n ${FAKE_ENV:-} ]] && env >"$FAKE_ENV"\n'
            'for s in ${FAKE_SIGNAL:-}; do kill -"$s" "$PPID"; sleep 0.1; done\nsleep 0.3\n'
            '[[ -n ${FAKE_SAVE:-} ]] && echo "$FAKE_SAVE" >"$FAKE_RESULTS"\nexit "${FAKE_RC:-0}"',
    # a job's state (%T): FAKE_STATES="41=COMPLETED 43=RUNNING"; a job not named there Slurm no longer lists;
    # FAKE_SQUEUE_ERR: squeue fails with that message
    "squeue": 'case "$*" in *%r*) echo "${FAKE_REASON:-None}" ;; *%l*) echo "${FAKE_LIMIT:-30:00}" ;; '
              '*%T*) [[ -n ${FAKE_SQUEUE_ERR:-} ]] && { echo "$FAKE_SQUEUE_ERR" >&2; exit 1; }\n'
              '  for p in ${FAKE_STATES:-}; do [[ ${p%%=*} == "$3" ]] && { echo "${p#*=}"; exit 0; }; done\n'
              '  echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;\n'
              '*) echo RUNNING ;; esac',
    "sacct": 'echo "${FAKE_STATE:-RUNNING}"',
    # FAKE_REQUEUE_ERR: `scontrol requeue` fails with that message
    "scontrol": 'if [[ $1 == requeue ]]; then [[ -n ${FAKE_REQUEUE_ERR:-} ]] && { echo "$FAKE_REQUEUE_ERR" >&2; exit 1; }; '
                'echo "requeue $2" >>"$FAKE_CALLS"; '
                'elif [[ $2 == hostnames ]]; then printf "%s\\n" ${FAKE_HOSTS:-node1}; else '
                'echo "   Command=$FAKE_COMMAND"; fi',
    # FAKE_SCANCEL_SLEEP: a slow scancel keeps the batch shell in its trap while srun ends
    "scancel": '[[ -n ${FAKE_SCANCEL:-} ]] && echo "$*" >>"$FAKE_SCANCEL"\nsleep "${FAKE_SCANCEL_SLEEP:-0}"\nexit 0',
    "getent": 'printf "10.0.0.4 STREAM %s\\n10.0.0.4 DGRAM\\n" "$2"',  # every host is 10.0.0.4
    # the preflight (megatron_ext.launch --check) passes and prints FAKE_CHECK_OUT; FAKE_HOST_PYTHON_FAILS: only in
    # the "container" (PATH = FAKE_CONTAINER_PATH), as a batch host's python without torch
    "python": '[[ -n ${FAKE_HOST_PYTHON_FAILS:-} && $PATH != "${FAKE_CONTAINER_PATH:-}" ]] && exit 1\n'
              '[[ -n ${FAKE_CHECK_OUT:-} ]] && echo "$FAKE_CHECK_OUT"\nexit 0',
}


@pytest.fixture
def job(tmp_path):
    """Run a spool copy of slurm/cpt_1m.sh as a batch job submitted from an unrelated folder."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    spool = tmp_path / "spool_script"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    calls = tmp_path / "calls"
    calls.touch()

    def run(script: str = "cpt_1m.sh", args: tuple[str, ...] = ("train.steps=3",),
            **fake: str) -> tuple[subprocess.CompletedProcess, str]:
        shutil.copy(ROOT / "slurm" / script, spool)
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_JOB_ID": "42",
               "SLURM_NTASKS": "2", "SLURM_SUBMIT_DIR": str(elsewhere), "PYTHON": str(bin_dir / "python"),
               "RECIPE": str(ROOT / "recipes/tiny/cpt.yaml"), "FAKE_CALLS": str(calls),
               "FAKE_COMMAND": f"{ROOT}/slurm/cpt_1m.sh train.steps=3", **fake}
        proc = subprocess.run(["bash", str(spool), *args], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=60)
        return proc, calls.read_text()

    return run


def test_found_from_another_folder_and_a_normal_requeue(job):
    """Negative control: the trainer saved on USR1 (exit 3) -> requeued. Before the fix, a job submitted from another
    folder died at once on `/elsewhere/slurm/common.sh: No such file or directory`."""
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="3")
    assert proc.returncode == 0, proc.stderr
    assert "working directory" in proc.stdout and "checkpoint saved; requeueing job 42 (restart 1)" in proc.stdout
    assert calls == "requeue 42\n"


def test_the_submitted_checkout_runs_not_the_one_submitted_from(job, tmp_path):
    """`cd ~/checkoutB && sbatch ~/checkoutA/slurm/cpt_1m.sh` ran B's common.sh, code and recipes without a word:
    the submit folder came first. The path of the submitted script does now (the submit folder is the fallback)."""
    other = tmp_path / "elsewhere/slurm"
    other.mkdir(parents=True)
    (other / "common.sh").write_text('stage_main() { echo "the other checkout ran" >&2; exit 7; }\n')
    proc, _ = job(FAKE_RC="0")
    assert proc.returncode == 0 and "the other checkout ran" not in proc.stderr, proc.stderr
    proc, _ = job(FAKE_RC="0", FAKE_COMMAND="")  # no Command= path from Slurm: the submit folder's
    assert proc.returncode == 7 and "the other checkout ran" in proc.stderr


def test_a_failed_requeue_is_one_line(job):
    """scontrol's own error, then 'scontrol requeue 42 failed' with no way forward: one line with both."""
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="3", FAKE_REQUEUE_ERR="Requested operation is presently disabled for job 42")
    assert proc.returncode == 1 and calls == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["error: scontrol requeue 42 failed (Requested operation is presently disabled for job 42): "
                                        "not requeued; submit the job again to go on from where this one stopped"]


def test_scancel_is_not_undone_by_a_requeue(job):
    """scancel sends TERM; the trainer saves and exits 3. Before the fix the script requeued the cancelled job."""
    proc, calls = job(FAKE_SIGNAL="TERM", FAKE_RC="3", FAKE_REASON="None", FAKE_STATE="CANCELLED by 0")
    assert "job cancelled (scancel): not requeued" in proc.stdout, proc.stdout + proc.stderr
    assert calls == ""


def test_a_step_that_ends_during_the_signal_trap_keeps_its_exit_status(job):
    """The tasks saved and exited 3 while the batch shell was still in its USR1 trap (a slow scancel): `wait` gave the
    trap's 138, which the script took for "USR1 before training started" (no save). Now: srun's own 3, requeued."""
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="3", FAKE_SCANCEL_SLEEP="1", FAKE_LIMIT="10:00")
    assert "training exited with 3" in proc.stdout, proc.stdout + proc.stderr
    assert calls == "requeue 42\n" and "checkpoint saved; requeueing job 42" in proc.stdout


def test_usr2_saves_and_stops_without_a_requeue(job, tmp_path):
    """`scancel --batch --signal=USR2 JOB`: the tasks get USR1 (save and exit 3), the job is not requeued."""
    forwarded = tmp_path / "scancel.txt"
    proc, calls = job(FAKE_SIGNAL="USR2", FAKE_RC="3", FAKE_SCANCEL=str(forwarded))
    assert proc.returncode == 3 and calls == "", proc.stdout + proc.stderr
    assert forwarded.read_text() == "--signal=USR1 42\n"
    assert "stopped on request (USR2): checkpoint saved; not requeued" in proc.stdout
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="3")  # control: the warning signal requeues
    assert calls == "requeue 42\n"
    # the time-limit warning while the stopped tasks save: still a stop, not a requeue
    proc, calls = job(FAKE_SIGNAL="USR2 USR1", FAKE_RC="3", FAKE_LIMIT="UNLIMITED")
    assert calls == "requeue 42\n" and "stopped on request (USR2)" in proc.stdout, proc.stdout + proc.stderr


def test_term_at_the_time_limit_still_requeues(job):
    proc, calls = job(FAKE_SIGNAL="TERM", FAKE_RC="3", FAKE_REASON="TimeLimit", FAKE_STATE="TIMEOUT")
    assert calls == "requeue 42\n", proc.stdout + proc.stderr


def test_warning_before_training_started_does_not_requeue_in_a_loop(job):
    """USR1 killed the tasks before the trainer's handler (exit 138) right at the start of a 10-minute job: the
    requeued job would get it as early. Before the fix it requeued (up to MAX_REQUEUES times), logging
    'checkpoint saved' although nothing was saved."""
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="138", FAKE_LIMIT="10:00")
    assert proc.returncode == 1 and calls == ""
    assert "before training started" in proc.stderr and "longer --time" in proc.stderr
    assert "checkpoint saved" not in proc.stdout
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="138", FAKE_LIMIT="UNLIMITED")  # no time limit: a manual USR1
    assert calls == "requeue 42\n" and "nothing saved" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("command, results", [((), "results.json"), (("ruler",), "ruler.json")])
def test_evaluation_warned_at_start_requeues_only_after_a_save(job, tmp_path, command, results):
    """slurm/niah.sh: a NIAH grid stopped by a USR1 that comes as it starts (a time limit not longer than the
    warning) requeued with --resume up to MAX_REQUEUES times, saving nothing each time. It still requeues when the
    run saved results (the grid goes on) or when the warning came late. RULER saves ruler.json: its saves were not
    seen (the script looked at results.json only), so a RULER job warned early was never requeued."""
    out = tmp_path / "niah"
    out.mkdir()
    (out / results).write_text("{}\n")  # from an earlier run
    grid = (*command, "--megatron", "runs/x", "--cp", "2", "--lengths", "1K", "--out", str(out))
    fake = {"FAKE_SIGNAL": "USR1", "FAKE_RC": "143", "FAKE_RESULTS": str(out / results)}
    proc, calls = job("niah.sh", grid, **fake, FAKE_LIMIT="5:00")
    assert proc.returncode == 1 and calls == "", proc.stdout + proc.stderr
    assert "no results were saved since it started" in proc.stderr and "longer --time" in proc.stderr
    proc, calls = job("niah.sh", grid, **fake, FAKE_LIMIT="5:00", FAKE_SAVE='{"cells": 1}')
    assert calls == "requeue 42\n" and "goes on with --resume" in proc.stdout, proc.stdout + proc.stderr
    proc, calls = job("niah.sh", grid, **fake, FAKE_LIMIT="UNLIMITED")
    assert calls == "requeue 42\nrequeue 42\n", proc.stdout + proc.stderr


def test_warning_as_a_finished_run_exits_is_success(job):
    """The last save done, USR1 killed the tasks on their way out: the run is complete, not failed or requeued."""
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="138", FAKE_LIMIT="10:00",
                      FAKE_CHECK_OUT="checkpoint: nothing to train: the checkpoint is at step 3, train.steps = 3")
    assert proc.returncode == 0 and calls == "", proc.stdout + proc.stderr
    assert "USR1 came while the tasks were exiting" in proc.stdout


def test_warning_as_a_finished_container_run_exits_is_success(job, tmp_path):
    """The same with CONTAINER_IMAGE, where the batch host's python cannot run the check (no torch there): it asks in
    the container, as the preflight does (before, the finished run was requeued once)."""
    container = tmp_path / "container_bin"
    container.mkdir()
    (container / "bash").symlink_to(shutil.which("bash"))  # the stub python's interpreter
    proc, calls = job(FAKE_SIGNAL="USR1", FAKE_RC="138", FAKE_LIMIT="10:00", CONTAINER_IMAGE="img.sqsh",
                      FAKE_HELP="--container-image", FAKE_CONTAINER_PATH=str(container), FAKE_CHECKS=str(tmp_path / "c"),
                      FAKE_HOST_PYTHON_FAILS="1",
                      FAKE_CHECK_OUT="checkpoint: nothing to train: the checkpoint is at step 3, train.steps = 3")
    assert proc.returncode == 0 and calls == "", proc.stdout + proc.stderr
    assert "USR1 came while the tasks were exiting" in proc.stdout


def test_slurm_seconds():
    script = f'source "{ROOT}/slurm/common.sh"; for t in 10:00 1:00:00 2-01:00:05 0:07 UNLIMITED; do ' \
             'echo "[$(slurm_seconds "$t")]"; done'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[600]", "[3600]", "[176405]", "[7]", "[]"]


def test_a_missing_project_is_one_error_line(tmp_path):
    spool = tmp_path / "spool_script"
    shutil.copy(ROOT / "slurm/sft.sh", spool)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "none-such", "SLURM_SUBMIT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(spool)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("error: slurm/common.sh not found; set MEGATRON_EXT_ROOT=<project folder>; nothing "
                                   "launched")
    assert Path(tmp_path / "slurm").exists() is False


def _wrapped_words(dry_run_line: str) -> list[str]:
    """The words of a dry-run sbatch line's `--wrap` command as sbatch's /bin/sh splits them."""
    wrap = subprocess.run(["bash", "-c", 'eval "set -- $1"; for a; do [[ $a == --wrap=* ]] && printf %s "${a#--wrap=}"; '
                           'done', "_", dry_run_line], capture_output=True, text=True).stdout
    return subprocess.run(["sh", "-c", f'for a in {wrap}; do printf "%s\\n" "$a"; done'], capture_output=True,
                          text=True).stdout.splitlines()


def test_pipeline_paths_are_the_callers(tmp_path):
    """pipeline.sh moves to the project root to submit; --hf/--export given from another folder used to be read
    from the project root (the export written into the project, the conversion failing on a path that exists)."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--dry-run", "--no-sft", "--hf", "../models/m",
                           "--export", "out/x"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    convert, *_, export = proc.stdout.splitlines()
    assert ["tools/convert.py", "to-megatron", "--hf", f"{tmp_path}/../models/m"] == _wrapped_words(convert)[1:5]
    assert ["--out", f"{tmp_path}/out/x"] == _wrapped_words(export)[-2:]
    proc = subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--export"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr == "error: --export needs a value (see --help); nothing launched\n"


def test_a_stage_script_given_help_prints_its_header():
    """`sbatch slurm/cpt_1m.sh -h`: the recipe check printed its help and passed, and every task of the job then
    printed the trainer's help and the job ended, having trained nothing."""
    for args in (["--help"], ["train.steps=2", "-h"]):
        proc = subprocess.run(["bash", str(ROOT / "slurm/cpt_1m.sh"), *args], capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"})
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.startswith("UltraLong CPT to 1M tokens") and "#SBATCH --" not in proc.stdout


def test_the_evaluation_script_given_help_prints_its_header(job, tmp_path):
    """`slurm/niah.sh --help` said 'run this with sbatch'; in a job every task ran `tools/niah.py --help`. Now the
    header, outside a job and in one (srun not run), as the stage scripts do."""
    for args in (["--help"], ["ruler", "--megatron", "runs/x", "-h"]):
        proc = subprocess.run(["bash", str(ROOT / "slurm/niah.sh"), *args], capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"})
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.startswith("Long-context evaluation of a Megatron checkpoint") and "#SBATCH --" not in proc.stdout
        assert "Arguments are tools/niah.py's (`python tools/niah.py --help`)" in proc.stdout
    argv = tmp_path / "argv"
    proc, _ = job("niah.sh", ("--megatron", "runs/x", "--help"), FAKE_ARGV=str(argv))
    assert proc.returncode == 0 and not argv.exists(), proc.stdout + proc.stderr
    assert proc.stdout.startswith("Long-context evaluation of a Megatron checkpoint")


def test_the_evaluation_job_logs_what_it_runs(job):
    """A RECIPE exported in the submitting shell (the stage scripts read it) made a niah.sh job log 'recipe X' and
    'overrides: <its tools/niah.py arguments>': a recipe it does not run. Now the arguments its tasks run."""
    grid = ("--megatron", "runs/x", "--cp", "2", "--lengths", "1K", "--out", "runs/n")
    proc, _ = job("niah.sh", grid)  # the fixture exports RECIPE, as such a shell would
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "] recipe " not in proc.stdout and "overrides:" not in proc.stdout, proc.stdout
    assert "relative paths in the arguments are taken from here" in proc.stdout
    assert "tools/niah.py arguments: --megatron runs/x --cp 2 --lengths 1K --out runs/n\n" in proc.stdout
    proc, _ = job()  # a stage still logs its recipe and overrides
    assert f"recipe {ROOT}/recipes/tiny/cpt.yaml\n" in proc.stdout and "overrides: train.steps=3\n" in proc.stdout


def test_pipeline_help_is_its_whole_header():
    """--help printed the first 24 header lines of 26: not where the jobs run, how paths are read, or PYTHON."""
    proc = subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--help"], capture_output=True, text=True,
                          timeout=60)
    lines = (ROOT / "slurm/pipeline.sh").read_text().splitlines()[1:]  # after the #! line
    header = [line[2:] for line in itertools.takewhile(lambda line: line.startswith("#"), lines)]
    assert proc.returncode == 0 and proc.stdout.splitlines() == header, proc.stdout
    assert header[-1].endswith("PYTHON selects the python (default: python).")


def _pipeline_dry_run(tmp_path, sbatch_args: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", SBATCH_ARGS=sbatch_args)
    return subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--dry-run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sbatch_args, overrides, per_node, nodes, gpus", [
    ("", [], 8, 4, "8"),  # TP 8 x CP 4 of cpt_1m on the recipe's 8 GPUs per node
    ("--account=a --gpus-per-node=4 --ntasks-per-node=4", [], 4, 8, "4"),  # 4-GPU nodes: was 8 per node, refused
    ("", ["cluster.gpus_per_node=4"], 4, 8, "4"),
    # the other forms sbatch takes were not read: 8 per node asked of 4-GPU nodes (the GPU type dropped)
    ("--gpus-per-node 4", [], 4, 8, "4"),
    ("--gpus-per-node=h100:4", [], 4, 8, "h100:4"),
    ("--gpus-per-node h100:4", [], 4, 8, "h100:4"),
    ("--gres=gpu:4", [], 4, 8, "4"),
    ("--gres gpu:h100:4,nvme:1", [], 4, 8, "h100:4"),
    ("--gres=gpu:h100", [], 1, 32, "h100:1"),  # count 1 by default
    # TP 2 x CP 4 on 6-GPU nodes: 2 nodes x 6 = 12 tasks for 8 ranks, a job that failed as it started
    ("--gpus-per-node=6", ["parallel.tensor=2", "parallel.context=4", "train.global_batch_size=96"], 4, 2, "4"),
])
def test_pipeline_evaluation_jobs_fit_the_nodes(tmp_path, sbatch_args, overrides, per_node, nodes, gpus):
    proc = _pipeline_dry_run(tmp_path, sbatch_args, "--no-sft", "--hf", "/m", "--niah", "128K:1M:4", *overrides)
    assert proc.returncode == 0, proc.stderr
    niah = [line for line in proc.stdout.splitlines() if "slurm/niah.sh" in line]
    assert len(niah) == 1 and f"--nodes={nodes} --ntasks-per-node={per_node} --gpus-per-node={gpus} " in niah[0]


@pytest.mark.parametrize("sbatch_args, said", [
    ("--gpus-per-node=lots", "--gpus-per-node=lots is not [type:]count"),
    ("--gres=gpu:h100:2k", "--gres=gpu:h100:2k: its gpu entry is not gpu[:type][:count]"),
    ("--account=a --gpus-per-node", "--gpus-per-node has no value"),
    # the job's GPUs in all were not read at all: the recipe's 8 per node asked of the nodes
    ("--gpus=16", "--gpus=16 counts the job's GPUs in all, not per node"),
    ("--gpus-per-node=4 -G h100:16", "-G h100:16 counts the job's GPUs in all, not per node"),
    ("-G16", "-G16 counts the job's GPUs in all, not per node"),
])
def test_pipeline_refuses_gpus_per_node_it_cannot_read(tmp_path, sbatch_args, said):
    """Where the evaluation jobs' size depends on it, GPUs per node that the pipeline cannot read are one line, not
    a guess (the recipe's 8 were asked of the nodes before)."""
    proc = _pipeline_dry_run(tmp_path, sbatch_args, "--no-sft", "--niah", "128K")
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: SBATCH_ARGS='{sbatch_args}': {said}, which sizes the --niah/--ruler jobs; give GPUs per node as "
        "--gpus-per-node=[type:]N or --gres=gpu[:type]:N; nothing launched"]


def test_pipeline_with_no_gpus_per_node(tmp_path):
    """SBATCH_ARGS=--gpus-per-node=0 with --niah ended in bash's 'division by 0' after the recipe reads. CPU nodes are
    a setup the stage scripts and slurm/niah.sh run (runtime.device=cpu; tests/slurm): the evaluation job then asks no
    GPUs and runs the recipe's cluster.gpus_per_node tasks per node; a cuda recipe on no GPUs is one line."""
    cpu = ("runtime.device=cpu", "parallel.sequence_parallel=false")  # sequence parallelism needs TE's norms
    for form in ("--gpus-per-node=0", "--gres gpu:0"):
        proc = _pipeline_dry_run(tmp_path, form, "--no-sft", "--niah", "128K", *cpu)
        assert proc.returncode == 0, proc.stderr
        niah = [line for line in proc.stdout.splitlines() if "slurm/niah.sh" in line]
        assert len(niah) == 1 and "--nodes=4 --ntasks-per-node=8 --gpus-per-node=0 slurm/niah.sh" in niah[0], niah
    proc = _pipeline_dry_run(tmp_path, "--gpus-per-node=0", "--no-sft", "--niah", "128K")
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [
        "error: SBATCH_ARGS='--gpus-per-node=0' asks for no GPUs, but recipes/cpt_1m.yaml has runtime.device = cuda "
        "(the cpt_1m job would stop at its recipe check); give the override runtime.device=cpu, or GPUs per node "
        "(--gpus-per-node=N); nothing launched"]
    proc = _pipeline_dry_run(tmp_path, "--gpus-per-node=0", *cpu)  # the SFT recipe's own device
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [
        "error: SBATCH_ARGS='--gpus-per-node=0' asks for no GPUs, but recipes/sft.yaml has runtime.device = cuda "
        "(the sft job would stop at its recipe check); give --sft-recipe with runtime.device: cpu or --no-sft, or GPUs "
        "per node (--gpus-per-node=N); nothing launched"]


def test_loopback_master_addr_from_the_login_shell_stops_a_multi_node_job(job):
    """sbatch exports the submitting shell's MASTER_ADDR; before, a 2-node job took 'localhost' as its rendezvous
    and the second node's ranks waited for themselves until the timeout."""
    proc, calls = job(MASTER_ADDR="localhost", SLURM_JOB_NUM_NODES="2", FAKE_RC="0")
    assert proc.returncode == 1 and "MASTER_ADDR=localhost (from the submitting shell)" in proc.stderr
    assert "training exited" not in proc.stdout
    proc, _ = job(MASTER_ADDR="localhost", SLURM_JOB_NUM_NODES="1", FAKE_RC="0")  # one node: loopback is right
    assert proc.returncode == 0 and "training exited with 0" in proc.stdout, proc.stderr


@pytest.mark.parametrize("nodes", ["1", "2"])
def test_a_master_addr_left_from_another_job_stops_the_job(job, nodes):
    """A MASTER_ADDR exported in the login shell (from an earlier interactive job) sent every rank to a host where
    nobody listens, until the 30-minute timeout. Rank 0 is on the job's first node: it, a name it starts (an
    interface's host name) or one of its addresses is accepted; anything else stops the job at once."""
    hosts = "gpu004 gpu005" if nodes == "2" else "gpu004"
    for addr in ("gpu017", "gpu0040", "gpu005"):
        proc, _ = job(MASTER_ADDR=addr, SLURM_JOB_NUM_NODES=nodes, FAKE_HOSTS=hosts, FAKE_RC="0")
        assert proc.returncode == 1 and "training exited" not in proc.stdout, (addr, proc.stderr)
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: MASTER_ADDR={addr} (from the submitting shell) is not this job's first node gpu004, where "
            "rank 0 listens for the other ranks; unset MASTER_ADDR before sbatch (the first node is used); nothing "
            "launched")
    for addr in ("gpu004", "gpu004-ib0", "gpu004.cluster.local"):
        proc, _ = job(MASTER_ADDR=addr, SLURM_JOB_NUM_NODES=nodes, FAKE_HOSTS=hosts, FAKE_RC="0")
        assert proc.returncode == 0 and "training exited with 0" in proc.stdout, (addr, proc.stderr)


def test_the_first_nodes_address_is_a_good_master_addr(job):
    proc, _ = job(MASTER_ADDR="10.0.0.4", SLURM_JOB_NUM_NODES="2", FAKE_HOSTS="gpu004 gpu005", FAKE_RC="0")
    assert proc.returncode == 0 and "training exited with 0" in proc.stdout, proc.stderr
    proc, _ = job(MASTER_ADDR="10.0.0.40", SLURM_JOB_NUM_NODES="2", FAKE_HOSTS="gpu004 gpu005", FAKE_RC="0")
    assert proc.returncode == 1 and "MASTER_ADDR=10.0.0.40 (from the submitting shell) is not" in proc.stderr


def test_torchrun_variables_from_the_submitting_shell_do_not_reach_the_tasks(job, tmp_path):
    """sbatch exports the submitting shell; RANK etc. from a shell inside torchrun or submitit would win over each
    task's SLURM_PROCID (megatron_ext.runtime reads torchrun's first), making every task the same rank."""
    env_file = tmp_path / "task_env"
    proc, _ = job(RANK="3", WORLD_SIZE="8", LOCAL_RANK="3", FAKE_RC="0", FAKE_ENV=str(env_file))
    assert proc.returncode == 0, proc.stderr
    assert "note: unset RANK WORLD_SIZE LOCAL_RANK from the submitting shell" in proc.stderr
    names = {line.split("=", 1)[0] for line in env_file.read_text().splitlines()}
    assert not names & {"RANK", "WORLD_SIZE", "LOCAL_RANK"} and "SLURM_JOB_ID" in names
    proc, _ = job(FAKE_RC="0", FAKE_ENV=str(env_file))  # control: nothing to unset, nothing said
    assert proc.returncode == 0 and "note: unset" not in proc.stderr


def bare_python(folder: Path) -> Path:
    """A python with PyYAML and the project but no torch or Megatron-Core (a login node's system python), whose
    `megatron_ext.launch --check` says so in one line of its own."""
    import yaml

    (folder / "site").mkdir()
    (folder / "site/yaml").symlink_to(Path(yaml.__file__).parent)
    script = folder / "bare_python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT}:{folder / "site"} exec {sys.executable} -S "$@"\n')
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("python, message", [
    ("/no/such/python", "PYTHON=/no/such/python: no such program"),
    ("false", "PYTHON=false cannot import torch, megatron.core and yaml"),  # runs, but is not the venv's python
    ("bare", "PYTHON={bare} cannot import torch, megatron.core and yaml"),  # the check's own error line came first
])
def test_a_python_without_the_dependencies_is_named(job, tmp_path, python, message):
    """Before: a traceback (ModuleNotFoundError: torch), 'No such file' or the check's own line, then this one."""
    if python == "bare":
        python = str(bare_python(tmp_path))
        message = message.format(bare=python)
    proc, calls = job(PYTHON=python)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {message}") and "export PYTHON=" in lines[0], proc.stderr
    assert lines[0].endswith("before sbatch; nothing launched")
    assert "training exited" not in proc.stdout


@pytest.mark.parametrize("script, args, fake, message", [
    ("cpt_1m.sh", ("train.steps=3",), {"SLURM_JOB_ID": ""}, "error: run this with sbatch (no SLURM_JOB_ID), e.g. "),
    ("cpt_1m.sh", ("train.steps=3",), {"RECIPE": "nope.yaml"},
     "error: recipe nope.yaml not found; set RECIPE=path/to/recipe.yaml"),
    ("cpt_1m.sh", ("train.steps=3",), {"MASTER_ADDR": "localhost", "SLURM_JOB_NUM_NODES": "2"},
     "error: MASTER_ADDR=localhost (from the submitting shell) on a 2-node job"),
    ("niah.sh", ("--cp", "2"), {"SLURM_JOB_ID": ""}, "error: run this with sbatch (no SLURM_JOB_ID), e.g. "),
    ("niah.sh", (), {}, "error: give tools/niah.py arguments, e.g. sbatch "),
    ("niah.sh", ("--cp", "2"), {"MASTER_ADDR": "gpu017", "FAKE_HOSTS": "gpu004"}, "error: MASTER_ADDR=gpu017 "),
])
def test_an_error_before_the_preflight_says_nothing_was_launched(job, tmp_path, script, args, fake, message):
    """The preflight's errors end in '; nothing launched', the ones before it (the arguments, the environment) did
    not, though no srun had run either."""
    argv = tmp_path / "argv"
    proc, _ = job(script, args, FAKE_ARGV=str(argv), **fake)
    assert proc.returncode == 1 and not argv.exists(), proc.stdout + proc.stderr  # srun not run
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message) and lines[0].endswith("; nothing launched"), proc.stderr


def test_an_option_given_to_a_stage_script_is_one_line(job):
    """Arguments after the script are recipe overrides; an option reached the check's argparse, which printed its
    usage and its error (then 'recipe check failed'): now one line."""
    proc, _ = job(args=("--bogus", "train.steps=3"), PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    assert proc.returncode == 1 and "training exited" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["error: unrecognized arguments: --bogus (give the script recipe overrides, "
                                        "dotted.key=value); nothing launched"]


@pytest.mark.parametrize("container", [False, True])
@pytest.mark.parametrize("crash, said, before", [
    ('"$@" -c "raise KeyError(\'bug\')"', "failed with exit 1", ["KeyError: 'bug'"]),
    ("kill -9 $$", "was killed by SIGKILL (exit 137)", []),  # e.g. out of memory, nothing printed
])
def test_a_check_that_crashes_still_says_nothing_was_launched(job, tmp_path, crash, said, before, container):
    """A real failure of the check's process (not an error it reports) ends in one line that nothing was launched,
    after what it (and srun) printed; the batch shell's own 'Killed' notice is not shown as well."""
    python = tmp_path / "crashing_python"
    python.write_text(f'#!/bin/bash\n[[ $1 == -c ]] && exec {sys.executable} "$@"\nset -- {sys.executable}\n{crash}\n')
    python.chmod(0o755)
    if container:
        container_env = dict(CONTAINER_IMAGE="img.sqsh", FAKE_HELP="--container-image",
                             FAKE_CONTAINER_PATH=os.environ["PATH"], FAKE_CHECKS=str(tmp_path / "checks"))
        before = before + [f"srun: error: node1: task 0: {'Killed' if before == [] else 'Exited with exit code 1'}"]
    proc, _ = job(PYTHON=str(python), **(container_env if container else {}))
    assert proc.returncode == 1 and "training exited" not in proc.stdout, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    above = "; its output is above" if before else ""
    ours = f"error: the recipe check ({python} -m megatron_ext.launch --check) {said}{above}; nothing launched"
    assert lines[-1 - len(before):] == [*before, ours], proc.stderr
    assert lines[0].startswith("Traceback") if before[:1] == ["KeyError: 'bug'"] else len(lines) == len(before) + 1


def test_pipeline_sft_recipe_path_with_a_comma(tmp_path, token_data, sft_data):
    """pipeline.sh gave the SFT job its recipe as `--export=ALL,RECIPE=PATH`, which sbatch splits at commas: a path
    with one lost its tail. Now RECIPE is in sbatch's own environment (the job inherits it with --export=ALL);
    sbatch is a stub that records what it got. Each stage's data is checked before the first submission."""
    recipes = tmp_path / "runs,v2" / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    sft_recipe = recipes / "sft.yaml"
    sft_recipe.write_text(sft_recipe.read_text().replace("prefix: data/sft ", f"prefix: {sft_data} "))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "sbatch").write_text('#!/usr/bin/env bash\nprintf "RECIPE=%s ARGS=%s\\n" "${RECIPE:-}" "$*" '
                                    '>>"$FAKE_CALLS"\nfor a; do [[ $a == --wrap=* ]] && printf %s "${a#--wrap=}" '
                                    '>"$FAKE_CALLS.wrap"; done\necho 7\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable, PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore", FAKE_CALLS=str(calls))
    env.pop("RECIPE", None)
    def pipeline(*overrides, **extra):
        return subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--sft-recipe", str(sft_recipe), *overrides],
                              cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True, timeout=120)

    # no CPT data: one line, nothing submitted; the SFT's data missing alike
    proc = pipeline("data.prefix=/nonexistent/cpt")
    assert proc.returncode == 1 and not calls.exists(), proc.stderr
    assert proc.stderr == ("error: data.prefix = '/nonexistent/cpt': /nonexistent/cpt.bin not found; run "
                           "tools/prepare_data.py first; nothing launched\n")
    good = sft_recipe.read_text()
    sft_recipe.write_text(good.replace(sft_data, "/nonexistent/sft"))
    proc = pipeline(f"data.prefix={token_data}")
    assert proc.returncode == 1 and not calls.exists() and "'/nonexistent/sft'" in proc.stderr, proc.stderr
    sft_recipe.write_text(good)
    # the convert and export jobs' paths alike (they would fail after the queue, export after all the training)
    (tmp_path / "hf").mkdir()
    proc = pipeline("--hf", "hf", f"data.prefix={token_data}")
    assert proc.returncode == 1 and not calls.exists(), proc.stderr
    assert proc.stderr == (f"error: --hf {tmp_path}/hf: no config.json there; give the Hugging Face model folder to "
                           "convert; nothing launched\n")
    (tmp_path / "hf/config.json").write_text("{}")
    proc = pipeline("--hf", "hf", f"data.prefix={token_data}", f"checkpoint.init_from={tmp_path}")
    assert proc.returncode == 1 and not calls.exists() and f"checkpoint.init_from {tmp_path} exists" in proc.stderr
    # another model than the recipe's (the CPT stage would refuse its conversion after the convert job): control first
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.recipe import load_recipe

    config = hf_config_from_recipe(load_recipe(recipes / "cpt_1m.yaml", [f"data.prefix={token_data}"]))
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    fresh = f"checkpoint.init_from={tmp_path}/converted"
    proc = pipeline("--hf", "hf", f"data.prefix={token_data}", fresh, "--dry-run")
    assert proc.returncode == 0 and not calls.exists(), proc.stderr
    assert subprocess.run([sys.executable, "-m", "megatron_ext.launch", "--recipe", str(recipes / "cpt_1m.yaml"),
                           "--check-hf", str(tmp_path / "hf"), f"data.prefix={token_data}"], env=env,
                          capture_output=True, text=True).returncode == 0
    (tmp_path / "hf/config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_hidden_layers": 2}))
    proc = pipeline("--hf", "hf", f"data.prefix={token_data}", fresh)
    assert proc.returncode == 1 and not calls.exists(), proc.stderr
    assert proc.stderr == (f"error: --hf {tmp_path}/hf is another model than recipe cpt_1m's (hidden_size: 64 -> 4096; "
                           "num_hidden_layers: 2 -> 32, as 'model folder -> recipe'): give the model the recipe "
                           "extends, or a recipe of this model; nothing launched\n")
    proc = pipeline("--export", ".", f"data.prefix={token_data}")
    assert proc.returncode == 1 and not calls.exists(), proc.stderr
    assert proc.stderr == (f"error: --export {tmp_path}/.: exists, and the export job does not overwrite; give a new "
                           "folder; nothing launched\n")
    # an evaluation folder with an earlier run's results: the job would refuse to overwrite them after the training
    sft_recipe.write_text(good.replace("dir: checkpoints/sft_1m", f"dir: {tmp_path}/sft_1m"))
    (tmp_path / "sft_1m_ruler").mkdir()
    (tmp_path / "sft_1m_ruler/ruler.json").write_text("{}")
    proc = pipeline("--ruler", "1M", f"data.prefix={token_data}")
    assert proc.returncode == 1 and not calls.exists(), proc.stderr
    assert proc.stderr == (f"error: --ruler: {tmp_path}/sft_1m_ruler holds an earlier evaluation's ruler.json, which "
                           "the ruler job does not overwrite; move or remove that folder first; nothing "
                           "launched\n")
    sft_recipe.write_text(good)
    # the export job's command: sbatch runs --wrap under /bin/sh, which took the $'...' quoting of bash's printf %q
    # (the C locale of many login nodes) literally
    export = tmp_path / "out" / "modèle l'été"
    proc = pipeline("--export", str(export), f"data.prefix={token_data}", LC_ALL="C")
    assert proc.returncode == 0, proc.stderr
    words = subprocess.run(["sh", "-c", 'for a in ' + Path(f"{calls}.wrap").read_text() + '; do echo "[$a]"; done'],
                           capture_output=True, text=True, env={"LC_ALL": "C"}).stdout.splitlines()
    assert words[1:] == ["[tools/convert.py]", "[to-hf]", "[--megatron]", "[checkpoints/sft_1m]", "[--out]",
                         f"[{export}]"], words
    calls.unlink()
    proc = pipeline(f"data.prefix={token_data}")
    assert proc.returncode == 0, proc.stderr
    cpt, sft = calls.read_text().splitlines()
    assert cpt.startswith("RECIPE=recipes/cpt_1m.yaml ARGS=--parsable slurm/cpt_1m.sh")
    assert sft.startswith(f"RECIPE={recipes}/sft.yaml ARGS=--parsable --dependency=afterok:7 ")
    assert "--export=ALL slurm/sft.sh checkpoint.init_from=checkpoints/cpt_1m" in sft


def test_pipeline_without_the_convert_tool_submits_nothing(tmp_path, token_data):
    """--export with tools/convert.py missing was found after the CPT job was submitted (it ran; the export did not
    exist): now before the first sbatch. A project folder without tools/; sbatch records its calls."""
    project = tmp_path / "project"
    for folder in ("slurm", "recipes"):
        shutil.copytree(ROOT / folder, project / folder)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "sbatch").write_text('#!/usr/bin/env bash\necho "$*" >>"$FAKE_CALLS"\necho 7\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable, PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore", FAKE_CALLS=str(calls))
    proc = subprocess.run(["bash", str(project / "slurm/pipeline.sh"), "--no-sft", "--export", "out",
                           f"data.prefix={token_data}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and not calls.exists(), proc.stderr
    assert proc.stderr.splitlines() == ["error: --export needs tools/convert.py, which is missing; nothing launched"]


def test_pipeline_sft_follows_the_cpt_stage(tmp_path):
    """After cpt_2m / cpt_4m the SFT job gets the recipe with that stage's RoPE (before: an error asking the user
    to write one)."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    for cpt, sft in (("cpt_1m", "sft.yaml"), ("cpt_2m", "sft_2m.yaml"), ("cpt_4m", "sft_4m.yaml")):
        proc = subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--dry-run", "--cpt", cpt], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert f"RECIPE=recipes/{sft} sbatch --parsable --dependency=afterok:\\<{cpt}\\> " in proc.stdout, proc.stdout
        assert f"slurm/sft.sh checkpoint.init_from=checkpoints/{cpt} " in proc.stdout


def test_pipeline_with_a_python_without_the_dependencies(tmp_path):
    """The login node's default python: one line naming PYTHON, not a traceback from the first recipe read."""
    proc = subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--dry-run"], cwd=tmp_path,
                          env=dict(os.environ, PYTHON=shutil.which("false") or "/bin/false"), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: PYTHON=") and "cannot import torch" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    # not there at all: said so (it was 'cannot import torch'), and not the recipe read's 'No such file'
    proc = subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--dry-run"], cwd=tmp_path,
                          env=dict(os.environ, PYTHON="/no/such/python"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: PYTHON=/no/such/python: no such program; run with "
                                        "PYTHON=/path/to/venv/bin/python (the environment megatron_ext is installed "
                                        "in); nothing launched"]


def test_task_prefix_runs_before_python_in_each_task(job, tmp_path):
    """TASK_PREFIX (e.g. an Nsight Systems capture for profile.tool=nsys) goes between srun's options and python,
    one argument per word; without it the task is python itself."""
    argv = tmp_path / "argv"
    prefix = "nsys profile --capture-range=cudaProfilerApi -o prof/rank%q{SLURM_PROCID}"
    proc, _ = job(TASK_PREFIX=prefix, FAKE_ARGV=str(argv))
    assert proc.returncode == 0 and f"task prefix: {prefix}" in proc.stdout, proc.stdout + proc.stderr
    words = argv.read_text().splitlines()
    python = words.index(str(tmp_path / "bin/python"))
    assert words[python - len(prefix.split()):python] == prefix.split()
    assert words[python + 1:python + 3] == ["-m", "megatron_ext.train"]
    job(FAKE_ARGV=str(argv))
    words = argv.read_text().splitlines()
    assert words[words.index(str(tmp_path / "bin/python")) - 1].startswith("--")  # srun's last option


def test_a_container_job_mounts_the_folder_it_was_submitted_from(job, tmp_path):
    """The tasks run in the submit folder (--container-workdir): one outside the project was not mounted, and pyxis
    could not start the container there."""
    argv = tmp_path / "argv"
    proc, _ = job(CONTAINER_IMAGE="img.sqsh", FAKE_HELP="--container-image", FAKE_ARGV=str(argv), FAKE_RC="0")
    assert proc.returncode == 0, proc.stderr
    elsewhere = tmp_path / "elsewhere"
    args = argv.read_text().splitlines()
    assert f"--container-mounts={ROOT}:{ROOT},{elsewhere}:{elsewhere}" in args
    assert f"--container-workdir={elsewhere}" in args and "--container-image=img.sqsh" in args


@pytest.fixture
def container_job(job, tmp_path, token_data):
    """A pyxis job whose preflight check runs for real in a "container" without squeue (the stub srun runs it with
    an empty PATH), on a checkpoint.dir whose .slurm_job names job 41; the batch host's squeue is the stub."""
    empty = tmp_path / "container_bin"
    empty.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".slurm_job").write_text("41\n")
    checks = tmp_path / "checks"

    def run(**fake: str):
        checks.write_text("")
        proc, _ = job(args=("train.steps=3", f"checkpoint.dir={run_dir}", f"data.prefix={token_data}"),
                      CONTAINER_IMAGE="img.sqsh", FAKE_HELP="--container-image", FAKE_CONTAINER_PATH=str(empty),
                      FAKE_CHECKS=str(checks), PYTHONWARNINGS="ignore", FAKE_RC="0", **{"PYTHON": sys.executable, **fake})
        return proc, (run_dir / ".slurm_job").read_text(), checks.read_text().splitlines()

    return run


@pytest.mark.parametrize("states", ["41=COMPLETED", "41=TIMEOUT", ""])  # "": Slurm no longer lists job 41
def test_a_container_job_takes_over_from_a_job_that_ended(container_job, states):
    """squeue is not in the container, where the preflight checks the claim: every new submission of a run whose
    last job had ended was refused ('whether it still runs is UNKNOWN') until the user deleted .slurm_job. Now the
    batch host asks Slurm and the check, told so, takes the claim over."""
    proc, owner, checks = container_job(FAKE_STATES=states)
    assert proc.returncode == 0 and "training exited with 0" in proc.stdout, proc.stdout + proc.stderr
    assert owner == "42\n"
    assert len(checks) == 2 and "--claim --host-squeue train.steps=3" in checks[0] and "--owner" not in checks[0]
    state = states.partition("=")[2]
    assert f"--host-squeue --owner-state 41={state} train.steps=3" in checks[1]
    assert f"on the batch host it is {state or 'no longer listed (ended)'}" in proc.stdout
    assert proc.stdout.count("ok: ") == 1, proc.stdout
    assert "claim-owner-unknown" not in proc.stdout


@pytest.mark.parametrize("state", ["RUNNING", "PENDING", "COMPLETING"])
def test_a_container_job_refuses_a_folder_a_live_job_writes(container_job, tmp_path, state):
    proc, owner, checks = container_job(FAKE_STATES=f"41={state} 43=COMPLETED")
    assert proc.returncode == 1 and "training exited" not in proc.stdout, proc.stdout + proc.stderr
    assert owner == "41\n" and len(checks) == 2
    assert f"is being written by Slurm job 41 ({state}); two runs in one folder" in proc.stderr
    # one line (before: the check's, srun's 'task 0: Exited with exit code 1', then 'recipe check failed')
    assert proc.stderr.splitlines() == [
        f"error: checkpoint.dir = '{tmp_path / 'run'}' is being written by Slurm job 41 ({state}); two runs in "
        "one folder overwrite each other's checkpoints. Wait for it, cancel it (scancel 41), or give this run another "
        "checkpoint.dir; nothing launched"]


def test_a_container_whose_python_lacks_torch_is_named_in_one_line(container_job, tmp_path):
    """The check in the container names a python without Megatron-Core in one line; before, find_spec('megatron.core')
    raised where `megatron` itself is missing: a traceback, srun's line, and 'recipe check failed'."""
    python = bare_python(tmp_path)
    proc, owner, _ = container_job(PYTHON=str(python))
    assert proc.returncode == 1 and "training exited" not in proc.stdout and owner == "41\n", proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: python {sys.executable} cannot import torch and megatron.core, which the trainer needs; use the python "
        "of the environment megatron_ext is installed in (sbatch: export PYTHON=/path/to/venv/bin/python); nothing "
        "launched"]


def test_a_python_the_container_lacks_is_named_in_one_line(container_job):
    """PYTHON not in the image: slurmstepd's execve() line, srun's 'Exited with exit code 2' and 'the recipe check
    ... failed with exit 2; its output is above' (3 lines). Now one, naming PYTHON, the image and the fix."""
    proc, owner, _ = container_job(PYTHON="/no/such/python")
    assert proc.returncode == 1 and "training exited" not in proc.stdout and owner == "41\n", proc.stderr
    assert proc.stderr.splitlines() == [
        "error: PYTHON=/no/such/python cannot be run in the container CONTAINER_IMAGE=img.sqsh (No such file or "
        "directory); export PYTHON=/path/to/python of the image's environment with megatron_ext's dependencies before "
        "sbatch; nothing launched"]


def test_a_missing_python_stops_an_evaluation_job_in_one_line(job, tmp_path):
    """slurm/niah.sh ran `srun $PYTHON tools/niah.py` as it was: a missing PYTHON gave slurmstepd's execve() line
    per task and srun's (3 lines on 2 tasks, tests/slurm's cluster), then 'evaluation exited with 2'."""
    argv = tmp_path / "argv"
    grid = ("--megatron", "runs/x", "--cp", "2", "--lengths", "1K", "--out", str(tmp_path / "niah"))
    proc, _ = job("niah.sh", grid, PYTHON="/no/such/python", FAKE_ARGV=str(argv))
    assert proc.returncode == 1 and not argv.exists(), proc.stdout + proc.stderr  # srun not run
    assert proc.stderr.splitlines() == ["error: PYTHON=/no/such/python: no such program; export "
                                        "PYTHON=/path/to/venv/bin/python before sbatch; nothing launched"]
    proc, _ = job("niah.sh", grid, FAKE_ARGV=str(argv))  # control: the stub python is found
    assert proc.returncode == 0 and argv.exists(), proc.stdout + proc.stderr


def test_a_container_job_where_the_host_cannot_ask_slurm_either(container_job, tmp_path):
    proc, owner, _ = container_job(FAKE_SQUEUE_ERR="slurm_load_jobs error: Unable to contact slurm controller")
    assert proc.returncode == 1 and "training exited" not in proc.stdout and owner == "41\n", proc.stderr
    assert ("is held by Slurm job 41, and whether it still runs is UNKNOWN (squeue on the batch host: "
            "slurm_load_jobs error: Unable to contact slurm controller)") in proc.stderr
    assert f"If job 41 has ended, delete {tmp_path}/run/.slurm_job" in proc.stderr


def test_a_container_job_keeps_its_own_claim_and_a_claim_that_changed_hands_is_asked_about(container_job, tmp_path):
    """A requeued job (the same id) asks nobody; a claim taken by job 43 between the two checks is asked about too."""
    (tmp_path / "run/.slurm_job").write_text("42\n")
    proc, owner, checks = container_job()
    assert proc.returncode == 0 and owner == "42\n" and len(checks) == 1, proc.stdout + proc.stderr
    (tmp_path / "run/.slurm_job").write_text("41\n")
    # the host's squeue answers, and job 43 claims the folder, before the second check
    squeue = tmp_path / "bin/squeue"
    squeue.write_text(squeue.read_text().replace("#!/usr/bin/env bash\n",
                                                 f"#!/usr/bin/env bash\necho 43 >{tmp_path}/run/.slurm_job\n"))
    proc, owner, checks = container_job(FAKE_STATES="41=COMPLETED 43=RUNNING")
    assert proc.returncode == 1 and owner == "43\n" and len(checks) == 3, proc.stdout + proc.stderr
    assert "--owner-state 41=COMPLETED --owner-state 43=RUNNING" in checks[2]
    assert "is being written by Slurm job 43 (RUNNING)" in proc.stderr


@pytest.mark.parametrize("version, ok", [("4 2", False), ("4 3", False), ("3 9", False), ("4 4", True),
                                         ("5 0", True), ('"${BASH_VERSINFO[0]}" "${BASH_VERSINFO[1]}"', True)])
def test_scripts_refuse_a_bash_older_than_4_4(version, ok):
    """Before bash 4.4 (EL7's 4.2) an empty array under `set -u` is an error, which slurm/*.sh expand often
    (a stage without overrides): common.sh, which every script and pipeline.sh source, refuses such a bash."""
    proc = subprocess.run(["bash", "-c", f"source slurm/common.sh && bash_at_least_4_4 {version}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode == 0) == ok, proc.stderr
