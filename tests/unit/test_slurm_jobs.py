"""megatron_ext.slurm_jobs and its use by the launcher: one live job per checkpoint.dir, the MAX_REQUEUES bound of
the submitit stages, a time limit that leaves room for the USR1 warning, a requeue by submitit's handler that ends
the task as a requeue. No Slurm needed: squeue is a stub."""

from __future__ import annotations

import os
import signal

import subprocess

import pytest

from megatron_ext import launch, launch_check
from megatron_ext.recipe import RecipeError
from megatron_ext.slurm_jobs import (OWNER_FILE, check_warning_fits, claim_checkpoint_dir, requeue_ends_the_task,
                                     requeue_refusal)


def test_claim_refuses_a_folder_another_live_job_writes(tmp_path):
    run = tmp_path / "run"
    claim_checkpoint_dir(str(run), "100", state_of=lambda job: None)
    assert (run / OWNER_FILE).read_text() == "100\n"
    claim_checkpoint_dir(str(run), "100", state_of=lambda job: "RUNNING")  # requeued: the same job id
    with pytest.raises(RecipeError, match=r"being written by Slurm job 100 \(RUNNING\).*scancel 100"):
        claim_checkpoint_dir(str(run), "101", state_of=lambda job: "RUNNING")
    with pytest.raises(RecipeError, match="job 100 .PENDING."):
        claim_checkpoint_dir(str(run), "101", state_of=lambda job: "PENDING")
    assert (run / OWNER_FILE).read_text() == "100\n"


@pytest.mark.parametrize("state", [None, "COMPLETED", "CANCELLED by 0", "FAILED", "PREEMPTED", "TIMEOUT"])
def test_claim_takes_over_from_a_job_that_ended(tmp_path, state):
    claim_checkpoint_dir(str(tmp_path), "100", state_of=lambda job: None)
    claim_checkpoint_dir(str(tmp_path), "101", state_of=lambda job: state)
    assert (tmp_path / OWNER_FILE).read_text() == "101\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [OWNER_FILE]


@pytest.mark.parametrize("script, state", [
    ("echo RUNNING", "RUNNING"),
    ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", None),  # Slurm has forgotten it: ended
    ("echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1",
     "UNKNOWN (squeue: slurm_load_jobs error: Unable to contact slurm controller)"),
    (None, "UNKNOWN (squeue: No such file or directory)"),  # no squeue, as in many containers
])
def test_job_state_tells_an_ended_job_from_one_it_cannot_ask_about(tmp_path, monkeypatch, script, state):
    """A live job's folder was taken over where squeue could not be asked (a container without Slurm's commands,
    a controller that did not answer): that counted as "ended". Now only Slurm's own "Invalid job id" does."""
    from megatron_ext.slurm_jobs import job_state

    if script is not None:
        (tmp_path / "squeue").write_text(f"#!/bin/sh\n{script}\n")
        (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert job_state("100") == state
    claim_checkpoint_dir(str(tmp_path / "run"), "100", state_of=lambda job: None)
    if state is not None and state.startswith("UNKNOWN"):
        with pytest.raises(RecipeError, match=rf"held by Slurm job 100, and whether it still runs is UNKNOWN .*If job "
                                              rf"100 has ended, delete .*run/{OWNER_FILE}"):
            claim_checkpoint_dir(str(tmp_path / "run"), "101")


def test_other_tasks_only_check_the_claim(tmp_path):
    """Under submitit every task checks (each stops by itself) and rank 0 alone writes: tasks of one job writing
    one temporary name at once made a rank's rename fail."""
    run = tmp_path / "run"
    claim_checkpoint_dir(str(run), "101", state_of=lambda job: "RUNNING", write=False)
    assert not run.exists()  # nothing written, not even the folder
    claim_checkpoint_dir(str(run), "100", state_of=lambda job: None)
    with pytest.raises(RecipeError, match=r"being written by Slurm job 100 \(RUNNING\)"):
        claim_checkpoint_dir(str(run), "101", state_of=lambda job: "RUNNING", write=False)
    claim_checkpoint_dir(str(run), "101", state_of=lambda job: None, write=False)  # 100 ended
    assert (run / OWNER_FILE).read_text() == "100\n"
    # a task of the job that holds the claim (its rank 0 wrote it) goes on, however squeue sees its job
    claim_checkpoint_dir(str(run), "100", state_of=lambda job: "RUNNING", write=False)


@pytest.fixture
def claim_check(monkeypatch, tmp_path):
    """`launch --check --claim ARGS` as slurm/common.sh's preflight runs it, as job 42 (the recipe loaded without its
    data checks) on a checkpoint.dir that job 41 claimed; squeue here answers `state_here`."""
    monkeypatch.setattr(launch_check, "check", lambda *a, **k: launch.load_recipe("recipes/tiny/cpt.yaml", a[1],
                                                                                   world_size=2))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    run = tmp_path / "run"
    claim_checkpoint_dir(str(run), "41", state_of=lambda job: None)
    asked = []

    def main(*args: str, state_here: str = "UNKNOWN (squeue: No such file or directory)") -> int:
        monkeypatch.setattr("megatron_ext.slurm_jobs.job_state", lambda job: asked.append(job) or state_here)
        return launch.main(["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", "--claim",
                            f"checkpoint.dir={run}", *args])

    main.owner = run / OWNER_FILE
    main.asked = asked
    return main


def test_a_check_that_cannot_ask_squeue_hands_the_question_to_the_batch_host(claim_check, capsys):
    """In a container (no squeue) a new job of a run whose last job had ended was refused until .slurm_job was
    deleted by hand. With --host-squeue the check ends with EXIT_ASK_HOST and the owner's id on its last line; by
    hand (no --host-squeue) the refusal is as before."""
    assert claim_check() == 1
    out, err = capsys.readouterr()
    assert "is held by Slurm job 41, and whether it still runs is UNKNOWN (squeue: No such file" in err
    assert "claim-owner-unknown" not in out
    assert claim_check("--host-squeue") == 5
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "claim-owner-unknown: 41" and err == ""
    assert claim_check.owner.read_text() == "41\n"
    # squeue answers here (a container with Slurm's commands): --host-squeue changes nothing
    assert claim_check("--host-squeue", state_here="RUNNING") == 1
    assert "being written by Slurm job 41 (RUNNING)" in capsys.readouterr().err
    assert claim_check("--host-squeue", state_here="COMPLETED") == 0 and claim_check.owner.read_text() == "42\n"


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED", ""])
def test_the_batch_hosts_answer_about_the_owner_decides(claim_check, capsys, state):
    assert claim_check("--host-squeue", "--owner-state", f"41={state}") == 0
    assert claim_check.owner.read_text() == "42\n" and claim_check.asked == []  # not asked again here


def test_the_batch_hosts_answer_refuses_a_live_owner_or_one_it_cannot_tell(claim_check, capsys):
    assert claim_check("--host-squeue", "--owner-state", "41=RUNNING") == 1
    assert "being written by Slurm job 41 (RUNNING)" in capsys.readouterr().err
    unknown = "UNKNOWN (squeue on the batch host: slurm_load_jobs error: Unable to contact slurm controller)"
    assert claim_check("--host-squeue", "--owner-state", f"41={unknown}") == 1  # not 5: no loop
    out, err = capsys.readouterr()
    assert f"whether it still runs is {unknown}: two runs" in err and "If job 41 has ended, delete" in err
    assert "claim-owner-unknown" not in out and claim_check.owner.read_text() == "41\n"


def test_the_owner_state_speaks_for_its_job_only(claim_check, capsys):
    """`--owner-state 41=COMPLETED` takes over only from job 41: with job 43 holding the folder (it claimed it after
    the batch host asked about 41, or the option was typed for another run), 43's state is asked as always."""
    claim_check.owner.write_text("43\n")
    assert claim_check("--owner-state", "41=COMPLETED", state_here="RUNNING") == 1
    assert "being written by Slurm job 43 (RUNNING)" in capsys.readouterr().err
    assert claim_check("--owner-state", "41=COMPLETED") == 1  # 43 unknown here, no --host-squeue: refused
    assert claim_check("--host-squeue", "--owner-state", "41=COMPLETED") == 5
    assert capsys.readouterr().out.splitlines()[-1] == "claim-owner-unknown: 43"
    assert claim_check.asked == ["43", "43", "43"] and claim_check.owner.read_text() == "43\n"


def test_the_internal_claim_options_are_checked(claim_check, capsys):
    with pytest.raises(SystemExit):
        claim_check("--owner-state", "COMPLETED")  # no job id
    assert "argument --owner-state: 'COMPLETED': give JOBID=STATE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        claim_check("--owner-state", "41x=COMPLETED")
    assert "give JOBID=STATE" in capsys.readouterr().err
    code = launch.main(["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", "--owner-state",
                        "41=COMPLETED"])
    assert code == 1 and "--owner-state and --host-squeue go with --claim" in capsys.readouterr().err
    assert claim_check.owner.read_text() == "41\n"


def test_requeue_refusal_bounds_restarts():
    assert requeue_refusal({"SLURM_RESTART_COUNT": "49"}) is None
    assert "50 restarts (MAX_REQUEUES = 50)" in requeue_refusal({"SLURM_RESTART_COUNT": "50"})
    assert requeue_refusal({"SLURM_RESTART_COUNT": "2", "MAX_REQUEUES": "3"}) is None
    assert "MAX_REQUEUES = 3" in requeue_refusal({"SLURM_RESTART_COUNT": "3", "MAX_REQUEUES": "3"})
    assert "not a whole number" in requeue_refusal({"MAX_REQUEUES": "ten"})


def test_submitit_stage_stops_requeueing_at_the_bound(monkeypatch, tmp_path):
    """Before, TrainStage ran `scontrol requeue` after every EXIT_REQUEUE, with no bound."""
    import megatron_ext.train as train

    calls = []
    monkeypatch.setattr(train, "main", lambda argv: train.EXIT_REQUEUE)
    status = {"rc": 0}

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, status["rc"], "", "slurm_requeue error: Access denied")

    monkeypatch.setattr(launch.subprocess, "run", run)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("MAX_REQUEUES", "2")
    stage = launch.TrainStage("recipes/tiny/cpt.yaml", [f"checkpoint.dir={tmp_path}"])
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(SystemExit, match="3"):
        stage()
    assert calls and calls[-1][:2] == ["scontrol", "requeue"]
    status["rc"] = 1  # the requeue refused: said, not a silent end of the job with "requeueing" in its log
    with pytest.raises(RuntimeError, match="scontrol requeue 5 failed \\(slurm_requeue error: Access denied\\): "
                                           "the checkpoint is saved; submit the stage again"):
        stage()
    calls.clear()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.raises(RuntimeError, match="not requeueing: 2 restarts"):
        stage()
    assert calls == []


def test_submitit_stage_refuses_a_folder_another_job_writes(monkeypatch, tmp_path):
    import megatron_ext.train as train

    monkeypatch.setattr(train, "main", lambda argv: pytest.fail("trained although another job holds the folder"))
    monkeypatch.setattr("megatron_ext.slurm_jobs.job_state", lambda job: "RUNNING")
    (tmp_path / OWNER_FILE).write_text("7\n")
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(SystemExit, match="error: checkpoint.dir .* Slurm job 7 .RUNNING."):
        launch.TrainStage("recipes/tiny/cpt.yaml", [f"checkpoint.dir={tmp_path}"])()


def test_time_limit_must_leave_room_for_the_warning(capsys):
    check_warning_fits("11", 11, 600)
    with pytest.raises(RecipeError, match="--time 10: not longer than the USR1 warning --signal-delay-s 600"):
        check_warning_fits("10", 10, 600)
    code = launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "00:05:00", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: --time 00:05:00: not longer than") and "Traceback" not in err
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "5", "--signal-delay-s", "60",
                        "--dry-run"]) == 0


def test_check_claims_only_when_asked(monkeypatch, tmp_path, capsys):
    """`--check --claim` (the sbatch preflight) records the job; a plain --check (a user in salloc) does not."""
    args = ["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", f"checkpoint.dir={tmp_path / 'r'}",
            "data.prefix=x"]
    monkeypatch.setattr(launch_check, "check", lambda *a, **k: launch.load_recipe("recipes/tiny/cpt.yaml", a[1],
                                                                                   world_size=2))
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    assert launch.main(args) == 0 and not (tmp_path / "r").exists()
    assert launch.main([*args, "--claim"]) == 0
    assert (tmp_path / "r" / OWNER_FILE).read_text() == "9\n"


def test_check_warns_of_training_beyond_the_models_positions(monkeypatch, capsys):
    """An override of train.seq_length alone trains past model.max_position_embeddings: the checkpoint and its
    export would claim the shorter context. The sbatch preflight (and the trainer's log) says so; not when within."""
    from megatron_ext.train_setup import positions_warning

    def run(*overrides):
        monkeypatch.setattr(launch_check, "check", lambda *a, **k: launch.load_recipe("recipes/tiny/cpt.yaml", a[1],
                                                                                       world_size=2))
        assert launch.main(["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", *overrides]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]

    assert run("checkpoint.dir=/nonexistent/r", "train.seq_length=4096") == [
        "warning: train.seq_length = 4,096 is beyond model.max_position_embeddings = 2,048: the checkpoint and its "
        "export will claim 2,048 positions; set model.max_position_embeddings (and the rope block) for the trained "
        "length, e.g. the recipe of that length"]
    assert run("checkpoint.dir=/nonexistent/r", "train.seq_length=2048") == []
    assert positions_warning(launch.load_recipe("recipes/cpt_4m.yaml")) is None  # the paper's recipes train at it


class _Submitit:
    """Stands in for submitit's USR1 handler (`checkpoint_and_try_requeue`): on rank 0 it requeues the job and raises
    SystemExit(-1); on other ranks it returns; when it may not requeue it raises (UncompletedJobError)."""

    def __init__(self, rank: int = 0, refuse: bool = False):
        self.rank, self.refuse, self.calls = rank, refuse, 0

    def __call__(self, signum, frame):
        self.calls += 1
        if self.refuse:
            raise RuntimeError("Job not requeued because: timed-out too many times.")
        if self.rank == 0:
            raise SystemExit(-1)


@pytest.fixture
def submitit_handler():
    previous = signal.getsignal(signal.SIGUSR1)
    yield lambda handler: signal.signal(signal.SIGUSR1, handler)
    signal.signal(signal.SIGUSR1, previous)


def _signalled_inside_an_extension_init():
    """USR1 arrives while a C extension initialises; what the extension's init makes of the handler's SystemExit
    (matplotlib's Agg renderer in a submitit NIAH job: `ImportError: initialization failed`)."""
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs here, in this thread
    except SystemExit as e:
        raise ImportError("initialization failed") from e
    raise AssertionError("the handler did not raise")


def test_requeue_ends_the_task_whatever_the_signal_interrupted(submitit_handler):
    handler = _Submitit()
    submitit_handler(handler)
    with pytest.raises(SystemExit) as exit_info:
        with requeue_ends_the_task():
            _signalled_inside_an_extension_init()
    assert exit_info.value.code == -1 and handler.calls == 1
    assert signal.getsignal(signal.SIGUSR1) is handler  # put back
    # negative control: without the block the requeued task ends in the ImportError, which submitit records as the
    # job's failed result
    with pytest.raises(ImportError, match="initialization failed"):
        _signalled_inside_an_extension_init()
    # a program that swallowed the exit and returned: the job is requeued all the same
    with pytest.raises(SystemExit) as exit_info:
        with requeue_ends_the_task():
            try:
                _signalled_inside_an_extension_init()
            except ImportError:
                pass
    assert exit_info.value.code == -1


@pytest.mark.parametrize("handler", [_Submitit(rank=1), _Submitit(refuse=True)], ids=["other rank", "not requeued"])
def test_without_a_requeue_exceptions_pass_unchanged(submitit_handler, handler):
    submitit_handler(handler)
    expected = RuntimeError if handler.refuse else ValueError
    with pytest.raises(expected):
        with requeue_ends_the_task():
            os.kill(os.getpid(), signal.SIGUSR1)
            raise ValueError("the program's own error")
    with requeue_ends_the_task():  # no signal, no error: nothing happens
        pass
    assert handler.calls == 1


def test_stages_chain_from_each_others_checkpoint_and_an_sft_keeps_its_rope(capsys, monkeypatch):
    """`--stages cpt_4m,sft` chains the SFT to cpt_4m's folder (sft.yaml's own init_from is the 1M checkpoint), and
    then it would train the 4M model with the 1M model's RoPE: an error naming the fix. Where the user sets the SFT's
    init_from to another folder it is kept, with a warning; `cpt_4m,sft_4m` chains cleanly; a CPT stage after
    another may change the RoPE (warned)."""
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)

    def run(stages, *overrides):
        code = launch.main(["--recipe", "recipes/cpt_4m.yaml", "--stages", stages, *overrides, "--dry-run"])
        captured = capsys.readouterr()
        return code, captured.err, captured.out

    code, err, _ = run("cpt_4m,sft")
    assert code == 1 and err.startswith("stage sft starts from 'checkpoints/cpt_4m', which stage cpt_4m writes (its "
                                        "recipe's checkpoint.init_from is 'checkpoints/cpt_1m')\nerror: stage sft "
                                        "starts from the checkpoint of stage cpt_4m with another RoPE (rope_scaling: ")
    assert "max_position_embeddings: 4194304 -> 1048576); an SFT keeps the RoPE" in err and "sft_4m.yaml" in err
    code, err, _ = run("cpt_4m,sft", "sft:checkpoint.init_from=checkpoints/cpt_1m")
    assert code == 0 and err == ("warning: stage sft starts from checkpoint.init_from = 'checkpoints/cpt_1m', not from "
                                 "'checkpoints/cpt_4m', which stage cpt_4m writes; to chain them add "
                                 "sft:checkpoint.init_from=checkpoints/cpt_4m\n")
    # the chain follows the folder the stage before really writes, and the job runs with it
    code, err, out = run("cpt_1m,sft", "cpt_1m:checkpoint.dir=/scratch/run1")
    assert code == 0 and err == ("stage sft starts from '/scratch/run1', which stage cpt_1m writes (its recipe's "
                                 "checkpoint.init_from is 'checkpoints/cpt_1m')\n")
    assert "checkpoint.init_from=/scratch/run1" in out.split("stage 2/2 sft")[1]
    # an init_from for every stage names where the first starts (the converted model): the SFT still chains
    code, err, out = run("cpt_1m,sft", "checkpoint.init_from=/lustre/llama31")
    assert code == 0 and err == ("stage sft starts from 'checkpoints/cpt_1m', which stage cpt_1m writes (its recipe's "
                                 "checkpoint.init_from is '/lustre/llama31')\n")
    assert out.split("stage 2/2 sft")[1].split("\n  run per task: ")[1].split("\n")[0].endswith(
        "checkpoint.init_from=/lustre/llama31 checkpoint.init_from=checkpoints/cpt_1m")  # the last one wins
    # the stage's own init_from, also as a section, is kept; a folder YAML would read as a number stays a path
    code, err, _ = run("cpt_4m,sft", "sft:checkpoint={init_from: checkpoints/cpt_1m, dir: checkpoints/sft_x}")
    assert code == 0 and err.startswith("warning: stage sft starts from checkpoint.init_from = 'checkpoints/cpt_1m'")
    code, err, out = run("cpt_4m,sft_4m", "cpt_4m:checkpoint.dir=\"2024\"")
    assert code == 0 and "checkpoint.init_from=\"2024\"" in out.split("stage 2/2 sft_4m")[1], out
    assert run("cpt_4m,sft_4m")[:2] == (0, "")
    code, err, _ = run("cpt_1m,cpt_4m", "cpt_4m:checkpoint.init_from=checkpoints/cpt_1m")
    assert code == 0 and "positions change from those it was trained with" in err
    # only an SFT stage is chained by itself: a CPT stage keeps its recipe's init_from, with a warning
    code, err, out = run("cpt_1m,cpt_4m")
    assert code == 0 and err == ("warning: stage cpt_4m starts from checkpoint.init_from = "
                                 "'checkpoints/llama31_8b_instruct', not from 'checkpoints/cpt_1m', which stage cpt_1m "
                                 "writes; to chain them add cpt_4m:checkpoint.init_from=checkpoints/cpt_1m\n"), err
    assert "checkpoint.init_from=checkpoints/cpt_1m" not in out.split("stage 2/2 cpt_4m")[1], out


def test_every_stages_data_is_checked_before_submitting(tmp_path, capsys, monkeypatch, token_data):
    """The SFT stage's data was first read by its job, after the queue and the CPT stage; now the chain is refused
    before anything is submitted (the dry run leaves it, as it leaves the first stage's paths)."""
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    args = ["--recipe", "recipes/tiny/cpt.yaml", "--stages", "cpt,sft", f"cpt:data.prefix={token_data}",
            f"cpt:checkpoint.dir={tmp_path / 'cpt'}", f"sft:checkpoint.dir={tmp_path / 'sft'}",
            "sft:data.prefix=/nonexistent/sft"]
    assert launch.main(args) == 1
    assert capsys.readouterr().err.splitlines()[-1] == ("error: stage sft: data.prefix = '/nonexistent/sft': "
                                                        "/nonexistent/sft.bin not found; run tools/prepare_data.py "
                                                        "first")
    assert launch.main([*args, "--dry-run"]) == 0


def test_a_stage_is_a_recipe_name_or_a_yaml_path(tmp_path):
    """`--stages sft` is `sft.yaml` beside the recipe (or in the folder given); a name ending in .yaml or .yml is a
    path as it is (stage_recipe's docstring): `x.yml` looked for `x.yml.yaml`."""
    from megatron_ext.launch_stages import plan_stages, stage_recipe

    assert stage_recipe("recipes/cpt_1m.yaml", "sft") == os.path.join("recipes", "sft.yaml")
    assert stage_recipe(str(tmp_path), "sft") == str(tmp_path / "sft.yaml")
    assert stage_recipe("recipes/cpt_1m.yaml", "other/a.yml") == "other/a.yml"
    assert stage_recipe("recipes/cpt_1m.yaml", "other/b.yaml") == "other/b.yaml"
    for name in ("a.yml", "b.yaml"):
        (tmp_path / name).write_text("{}\n")
    plan = plan_stages(str(tmp_path / "a.yml"), f"{tmp_path / 'a.yml'},b", ["b:train.steps=3", "train.seed=1"])
    assert [(s.name, s.recipe, s.overrides, s.own) for s in plan] == [
        ("a", str(tmp_path / "a.yml"), ["train.seed=1"], []),
        ("b", str(tmp_path / "b.yaml"), ["train.steps=3", "train.seed=1"], ["train.steps=3"])]


def test_stage_names_order_and_sizes_are_checked(capsys, monkeypatch, tmp_path):
    """A mistyped stage lists the recipes there; a stage that starts from what only a later one writes is refused
    (it would fail after its queue wait), not one that exists already; --gpus-per-node 0 is refused, not dropped
    (control: the right order passes)."""
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)

    def error(*argv):
        code = launch.main(["--recipe", "recipes/cpt_1m.yaml", *argv, "--dry-run"])
        err = capsys.readouterr().err
        return code, err.splitlines()[-1] if err else ""

    assert error("--stages", "cpt_1m,sftt") == (1, "error: --stages cpt_1m,sftt: stage 'sftt' has no recipe "
                                                   "'recipes/sftt.yaml'; a stage is a recipe name of 'recipes' without "
                                                   ".yaml (cpt_1m, cpt_2m, cpt_4m, sft, sft_2m, sft_4m), or a path to a "
                                                   ".yaml file")
    assert error("--stages", "sft,cpt_1m") == (1, "error: stage sft starts from 'checkpoints/cpt_1m', which stage "
                                                  "cpt_1m writes after it: list cpt_1m before sft in --stages")
    assert error("--gpus-per-node", "0") == (1, "error: --gpus-per-node 0: must be >= 1 (tasks, one per GPU, on each "
                                                "node)")
    assert error("--stages", "cpt_1m,sft")[0] == 0
    assert error("--stages", "sft,cpt_1m", f"sft:checkpoint.init_from={tmp_path}", f"cpt_1m:checkpoint.dir={tmp_path}"
                 )[0] == 0  # an SFT of the CPT run's checkpoint so far, then the CPT goes on


def test_tensor_parallel_groups_stay_within_a_node(monkeypatch):
    """On 4-GPU nodes TP 8 would put every layer's all-reduces on the network, silently slow: the preflight
    refuses it (control: 8 tasks per node)."""
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    with pytest.raises(RecipeError, match=r"parallel\.tensor = 8 with 4 tasks per node: tensor parallel groups "
                                          r"would span nodes"):
        launch.check("recipes/cpt_1m.yaml", [], 256, tasks_per_node=4, gpus_per_node=4, paths=False)
    assert launch.check("recipes/cpt_1m.yaml", [], 256, tasks_per_node=8, gpus_per_node=8, paths=False)


def test_submitit_path_keeps_tensor_parallel_groups_within_a_node(monkeypatch, capsys):
    """The launcher's jobs run one task per GPU: --gpus-per-node 4 with TP 8 is refused as the sbatch preflight
    refuses it (it was submitted: every TP group across two nodes); control: 8 GPUs per node."""
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    assert launch.main(["--recipe", "recipes/cpt_1m.yaml", "--gpus-per-node", "4", "--nodes", "64", "--dry-run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: stage cpt_1m: parallel.tensor = 8 with 4 tasks per node: tensor parallel groups would "
                   "span nodes (their all-reduce over the network in every layer); give a number of tasks per node "
                   "that parallel.tensor divides, or a smaller parallel.tensor"]
    assert launch.main(["--recipe", "recipes/cpt_1m.yaml", "--gpus-per-node", "8", "--nodes", "32", "--dry-run"]) == 0


def test_launch_refuses_an_evaluation_folder_with_earlier_results(tmp_path):
    """The NIAH job refuses an --out holding an earlier run's results.json: found before submitting, not by the job
    after the whole training (a dry run does not look at paths)."""
    import argparse

    from megatron_ext.launch_eval import eval_jobs
    from megatron_ext.recipe import load_recipe

    last = load_recipe("recipes/cpt_1m.yaml", [f"checkpoint.dir={tmp_path}/run"])
    args = argparse.Namespace(niah="128K", ruler=None, dry_run=False)

    def params(a, recipe, name):
        return {"nodes": 1, "ntasks_per_node": 8}

    assert len(eval_jobs(args, [last], params)) == 1
    (tmp_path / "run_niah").mkdir()
    (tmp_path / "run_niah/results.json").write_text("{}")
    with pytest.raises(RecipeError, match=rf"--niah: {tmp_path}/run_niah holds an earlier evaluation's results\.json, "
                                          r"which the niah job does not overwrite; move or remove that folder first"):
        eval_jobs(args, [last], params)
    assert len(eval_jobs(argparse.Namespace(niah="128K", ruler=None, dry_run=True), [last], params)) == 1


def test_an_evaluation_requeued_by_slurm_itself_resumes(monkeypatch, tmp_path):
    """Requeued without submitit's checkpoint (node failure, scontrol requeue, preemption by TERM), the job reran its
    first arguments, which the evaluation now refuses over the saved results: --resume is added, as niah.sh does."""
    import megatron_ext.evaluate.cli as cli
    from megatron_ext.launch_eval import EvalStage

    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(list(argv)))
    stage = EvalStage("niah", ["--megatron", "ckpt", "--out", str(tmp_path)], "results.json")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    stage()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    stage()
    assert seen == [["--megatron", "ckpt", "--out", str(tmp_path)], ["--megatron", "ckpt", "--out", str(tmp_path),
                                                                     "--resume"]]


def test_check_and_get_together_is_an_error(monkeypatch, capsys):
    """--check answered alone and dropped --get (exit 0, 'ok:'); control: --get alone prints the field."""
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    assert launch.main(["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", "--get",
                        "train.steps"]) == 1
    assert capsys.readouterr().err.strip() == "error: --check and --get: give one (--get prints a field of a recipe " \
                                              "that loads)"
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--get", "train.steps"]) == 0
    assert capsys.readouterr().out.strip().isdigit()
