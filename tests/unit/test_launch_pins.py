"""Pins of the launcher (megatron_ext.launch, launch_eval) from the mutation audit: the sbatch options a submission
carries, against Slurm's own semantics (afterok dependencies, --cpus-per-task). sbatch is a stub that records the
script submitit hands it and answers as sbatch does ('Submitted batch job N'); submitit itself runs for real."""

from __future__ import annotations

import os
import re
import stat
import sys

import pytest

from megatron_ext import launch
from tests.conftest import ROOT

TINY = ["train.seq_length=256", "train.global_batch_size=1", "train.lr=1e-2", "runtime.device=cpu"]


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    """A `sbatch` on PATH that copies each submitted script to scripts/<N>.sh and says 'Submitted batch job N'."""
    bin_dir, scripts = tmp_path / "bin", tmp_path / "scripts"
    bin_dir.mkdir()
    scripts.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!{sys.executable}\n"
                      "import os, sys\n"
                      f"folder = {str(scripts)!r}\n"
                      "n = 1000 + len(os.listdir(folder))\n"
                      "script = open(sys.argv[-1]).read()\n"
                      "open(os.path.join(folder, f'{n}.sh'), 'w').write(script)\n"
                      # the job 'ran' at once: submitit's result file where the job's would be, an error for the
                      # jobs named in FAKE_SBATCH_FAIL
                      "import pickle, re\n"
                      "out = re.search(r'^#SBATCH --output=(.*)$', script, re.M)[1].replace('%j', str(n))\n"
                      "name = re.search(r'^#SBATCH --job-name=(.*)$', script, re.M)[1]\n"
                      "failed = name in os.environ.get('FAKE_SBATCH_FAIL', '').split(',')\n"
                      "os.makedirs(os.path.dirname(out), exist_ok=True)\n"
                      "tasks = 1\n"
                      "for key in ('nodes', 'ntasks-per-node'):\n"
                      "    tasks *= int(re.search(rf'^#SBATCH --{key}=(\\d+)$', script, re.M)[1])\n"
                      "for t in range(tasks):\n"
                      "    pickle.dump(('error', 'boom') if failed else ('success', name),\n"
                      "                open(os.path.join(os.path.dirname(out), f'{n}_{t}_result.pkl'), 'wb'))\n"
                      "print(f'Submitted batch job {n}')\n")
    scancel = bin_dir / "scancel"  # records what the launcher cancels
    scancel.write_text(f"#!/bin/sh\necho \"$@\" >> {scripts}/scancel.log\n")
    for tool in (sbatch, scancel):
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(ROOT)
    return scripts


def sbatch_options(script) -> dict[str, str]:
    """The `#SBATCH --key=value` lines of a submitted script."""
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script.read_text(), re.M))


def test_both_evaluations_wait_for_the_last_stage_only(fake_sbatch, tmp_path, token_data, capsys):
    """--niah and --ruler each start after the last training stage (afterok on its job), not one after the other: a
    failed NIAH job must not make Slurm cancel the RULER job (--kill-on-invalid-dep) as it would with afterok:<niah>.
    Control: the RULER job chained on the NIAH job's id fails this."""
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(tmp_path / "sub/%j"),
                        "--niah", "256", "--ruler", "256", *TINY, f"data.prefix={token_data}",
                        f"checkpoint.dir={tmp_path / 'cpt'}"]) == 0, capsys.readouterr().err
    cpt, niah, ruler = (sbatch_options(fake_sbatch / f"{n}.sh") for n in (1000, 1001, 1002))
    assert (cpt["job-name"], niah["job-name"], ruler["job-name"]) == ("cpt", "niah", "ruler")
    assert "dependency" not in cpt
    assert niah["dependency"] == ruler["dependency"] == "afterok:1000"
    assert niah["kill-on-invalid-dep"] == ruler["kill-on-invalid-dep"] == "yes"


def test_cpus_per_task_is_the_one_asked_for(fake_sbatch, tmp_path, token_data, capsys):
    """--cpus-per-task reaches sbatch (it replaces the default, 8 per GPU task on cuda: 1 here would give each rank
    one CPU); control: the flag dropped leaves no --cpus-per-task for a CPU recipe."""
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(tmp_path / "sub/%j"),
                        "--cpus-per-task", "3", *TINY, f"data.prefix={token_data}",
                        f"checkpoint.dir={tmp_path / 'cpt'}"]) == 0, capsys.readouterr().err
    assert sbatch_options(fake_sbatch / "1000.sh")["cpus-per-task"] == "3"


def test_a_failed_evaluation_cancels_no_other(fake_sbatch, tmp_path, token_data, capsys, monkeypatch):
    """--wait: a failed NIAH job leaves the RULER job alone (both wait on the training stage only: afterok keeps it
    satisfiable), whose result is still printed; exit 1 for the failure. A failed training stage cancels the jobs
    after it. Control: the eval counted among the training stages cancels the RULER job."""
    run = ["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(tmp_path / "sub/%j"), "--wait",
           "--niah", "256", "--ruler", "256", *TINY, f"data.prefix={token_data}", f"checkpoint.dir={tmp_path / 'cpt'}"]
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "niah")
    assert launch.main(run) == 1
    out, err = capsys.readouterr()
    assert "done ruler: job 1002: " in out and "error: stage niah (job 1001) failed; cancelled 0 later stage(s)" in err
    assert not (fake_sbatch / "scancel.log").exists()
    # the training stage failing: Slurm would cancel both (afterok never satisfied); --wait cancels them at once
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "cpt")
    assert launch.main(run) == 1
    assert "error: stage cpt (job 1003) failed; cancelled 2 later stage(s)" in capsys.readouterr().err
    assert (fake_sbatch / "scancel.log").read_text().split() == ["1004", "1005"]


def test_an_evaluation_job_asks_one_gpu_per_task(monkeypatch, capsys):
    """The NIAH job of a TP 2 x CP 2 stage on 8-GPU nodes runs 4 tasks on one node and asks Slurm for 4 GPUs there
    (one per task, as the stage's own job), not the stage's 8. Control: the stage's gpus_per_node kept."""
    monkeypatch.chdir(ROOT)
    assert launch.main(["--recipe", "recipes/cpt_1m.yaml", "--niah", "128K", "--dry-run", "parallel.tensor=2",
                        "parallel.context=2", "train.global_batch_size=64"]) == 0
    niah = capsys.readouterr().out.split("then niah: ")[1]
    assert niah.startswith("4 processes")
    assert "  sbatch nodes: 1\n" in niah and "  sbatch ntasks_per_node: 4\n" in niah
    assert "  sbatch gpus_per_node: 4\n" in niah


def test_an_evaluation_job_has_exactly_its_ranks_as_tasks(monkeypatch, capsys):
    """TP 2 x CP 4 (8 ranks) on 6-GPU nodes: the NIAH job was 2 nodes x 6 tasks = 12 processes, which the evaluation
    refuses as it starts (12 is no multiple of TP x CP), after the whole training. Now 2 nodes x 4. Control: the old
    sizing gives 12 processes."""
    monkeypatch.chdir(ROOT)
    assert launch.main(["--recipe", "recipes/cpt_1m.yaml", "--niah", "128K", "--dry-run", "cluster.gpus_per_node=6",
                        "cluster.nodes=4", "parallel.tensor=2", "parallel.context=4",
                        "train.global_batch_size=96"]) == 0
    niah = capsys.readouterr().out.split("then niah: ")[1]
    assert niah.startswith("8 processes"), niah
    assert "  sbatch nodes: 2\n" in niah and "  sbatch ntasks_per_node: 4\n" in niah
    from megatron_ext.launch_eval import tasks_per_node

    # by hand: the most tasks per node that divides the ranks, whole TP groups first
    assert [tasks_per_node(*case) for case in [(8, 2, 8), (8, 2, 6), (12, 4, 8), (32, 8, 8), (32, 8, 4), (3, 1, 2)]] \
        == [8, 4, 4, 8, 4, 1]


def test_check_sizes_the_job_from_the_cluster_block(tmp_path, token_data, capsys, monkeypatch):
    """--check without --world-size: the job is cluster.nodes x cluster.gpus_per_node tasks (2 x 2 = 4 here), which
    the layout line reports (DP = 4 / (TP x PP x CP)). Control: the nodes left out (2 processes)."""
    monkeypatch.chdir(ROOT)
    assert launch.main(["--check", "--recipe", "recipes/tiny/cpt.yaml", *TINY, "cluster.nodes=2",
                        "cluster.gpus_per_node=2", "parallel.context=1", "train.global_batch_size=4",
                        f"data.prefix={token_data}",
                        f"checkpoint.dir={tmp_path / 'cpt'}"]) == 0, capsys.readouterr().err
    ok = capsys.readouterr().out.splitlines()[0]
    assert " TP1 PP1 CP1 DP4 on 4 processes (cpu)" in ok, ok


def test_slurm_is_asked_for_the_signal_the_tasks_handle(fake_sbatch, tmp_path, token_data):
    """The job script asks Slurm for USR1 before the time limit (#SBATCH --signal=USR1@S), the signal the trainer
    and the tasks' submitit handle (SUBMITIT_PREEMPT_SIGNAL=USR1 in the job setup). submitit reads the signal once,
    when it is first imported, and the folder check imported it before the launcher set it: the jobs asked for
    submitit's default USR2, which kills the ranks unsaved. In a fresh process (submitit not yet imported), as the
    command runs. Control: the old order gives USR2@600."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "SUBMITIT_PREEMPT_SIGNAL"}
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.launch", "--recipe", "recipes/tiny/cpt.yaml", "--time",
                           "30", "--folder", str(tmp_path / "sub/%j"), *TINY, f"data.prefix={token_data}",
                           f"checkpoint.dir={tmp_path / 'cpt'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sbatch_options(fake_sbatch / "1000.sh")["signal"] == "USR1@600"


def test_a_full_submit_folder_is_one_line_and_leaves_nothing(fake_sbatch, small_disk, tmp_path, token_data, capsys):
    """--folder on a full disk: submitit's pickle of the job cannot be written (before any sbatch). One line naming
    --folder, the cause and the fix, and the half-written pickle and the folders submitit made for it removed (they
    named no job, and each retry added one). Control: without the removal, sub/ and a 0-byte <uuid>.pkl stay."""
    with open(small_disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 4096)
    folder = small_disk / "sub" / "logs" / "%j"
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(folder), *TINY,
                        f"data.prefix={token_data}", f"checkpoint.dir={tmp_path / 'cpt'}"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: --folder {folder}: cannot write submitit's files for the cpt job there (No space left on device); "
        "free space there or give another folder; nothing launched"]
    assert [p.name for p in small_disk.iterdir()] == ["filler"]
    assert not list(fake_sbatch.iterdir())  # sbatch was never called
