"""Pins of submitting a chain's jobs (megatron_ext.launch_submit, through megatron_ext.launch) from the mutation audits
(rounds 7 and 9): the one line that ends a submission sbatch refused half-way, and what it leaves behind (ours
removed, another launch's kept). sbatch is the stub of test_launch_pins (submitit runs for real), taught to refuse the
jobs named in FAKE_SBATCH_REFUSE as Slurm does: 'sbatch: error: ...' on stderr, exit 1."""

from __future__ import annotations

import pytest

from megatron_ext import launch
from megatron_ext.launch_submit import Submitted, after, check_submit_folder
from megatron_ext.recipe import RecipeError
from tests.unit import test_launch_pins as launch_tests
from tests.unit.test_launch_pins import TINY

fake_sbatch = launch_tests.fake_sbatch  # the fixture: a stub sbatch on PATH

REFUSAL = ("if name in os.environ.get('FAKE_SBATCH_REFUSE', '').split(','):\n"
           "    sys.stderr.write('sbatch: error: CPU count per node can not be satisfied\\n'\n"
           "                     'sbatch: error: Batch job submission failed: Invalid account or account/partition "
           "combination specified\\n')\n"
           "    sys.exit(1)\n")


def test_what_a_failed_submission_says_of_the_jobs_before_it():
    """Nothing submitted: 'nothing launched'; one job or more: each named with its id, and the scancel that
    cancels all of them (LS1: one job was said as none; LS2: only the last was cancelled)."""
    jobs = Submitted()
    assert str(jobs.failed("sbatch refused the cpt job")) == "sbatch refused the cpt job; nothing launched"
    jobs.add("cpt", "7")
    assert str(jobs.failed("x")) == ("x; submitted before it: cpt (job 7), which Slurm runs as submitted: scancel 7 "
                                     "to cancel them")
    jobs.add("sft", "8")
    assert str(jobs.failed("x")).endswith(": cpt (job 7), sft (job 8), which Slurm runs as submitted: scancel 7 8 to "
                                          "cancel them")


@pytest.fixture
def refusing_sbatch(fake_sbatch, tmp_path):
    sbatch = tmp_path / "bin" / "sbatch"
    text = sbatch.read_text()
    anchor = "failed = name in"
    assert anchor in text
    sbatch.write_text(text.replace(anchor, REFUSAL + anchor, 1))
    return fake_sbatch


def test_sbatch_refusing_a_later_job(refusing_sbatch, tmp_path, token_data, capsys, monkeypatch):
    """The NIAH job refused after the CPT job was submitted: one line with sbatch's reason (each of its lines,
    LS19, without their 'sbatch: error: ' prefix, LS6), the CPT job as submitted (LS3) and its scancel; submitit's
    pickle and script of the refused job removed (LS5), and nothing else of submitit's left (its stderr kept from
    the terminal: LS15)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "niah")
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(mine / "%j"),
                        "--niah", "256", *TINY, f"data.prefix={token_data}",
                        f"checkpoint.dir={tmp_path / 'cpt'}"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: sbatch refused the niah job (CPU count per node can not be satisfied; Batch job submission failed: "
        "Invalid account or account/partition combination specified); submitted before it: cpt (job 1000), which "
        "Slurm runs as submitted: scancel 1000 to cancel them"]
    # the job's setup lines kept beside submitit's mark of the submission (LS4: the mark replaced them, and the job ran
    # without the project on PYTHONPATH or its preemption signal)
    script = (refusing_sbatch / "1000.sh").read_text()
    assert "\nexport PYTHONPATH=" in script and "\nexport SUBMITIT_PREEMPT_SIGNAL=" in script
    assert "\n# megatron_ext submission " in script
    assert mine.is_dir()
    # the CPT job's script moved to its folder 1000/, a link left in its place; nothing else of submitit's
    left = sorted(p.name for p in mine.iterdir() if not p.is_symlink())
    assert left == ["1000"], left


def test_sbatch_refusing_the_first_job_leaves_no_folder_it_made(refusing_sbatch, tmp_path, token_data, capsys,
                                                                monkeypatch):
    """The first job refused: 'nothing launched', and the folders submitit made for --folder removed up to the part
    that existed, the empty folder the user made, which stays (LS9)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "cpt")
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder",
                        str(mine / "sub" / "logs" / "%j"), *TINY, f"data.prefix={token_data}",
                        f"checkpoint.dir={tmp_path / 'cpt'}"]) == 1
    assert capsys.readouterr().err.endswith("combination specified); nothing launched\n")
    assert mine.is_dir() and not list(mine.iterdir())


def test_a_submit_folder_at_or_under_a_file(tmp_path):
    """--folder on a file, under a file or under a link to nowhere: refused before anything is submitted, naming
    what is there (LS16: the check dropped; LS10: 'is a file' and 'lies under' swapped; LS11: a dangling link
    passed, and submitit's makedirs ended in a FileExistsError traceback). The link is said to be one, with its
    target (it was called 'a file')."""
    (tmp_path / "f").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(RecipeError) as e:
        check_submit_folder(str(tmp_path / "f" / "%j"))
    assert str(e.value) == (f"--folder {tmp_path / 'f' / '%j'}: is a file, not a folder; give a folder for "
                            "submitit's logs and pickles")
    with pytest.raises(RecipeError, match=rf"/sub/%j: lies under {tmp_path / 'f'}, which is a file, not a folder; "):
        check_submit_folder(str(tmp_path / "f" / "sub" / "%j"))
    with pytest.raises(RecipeError) as e:
        check_submit_folder(str(tmp_path / "link" / "sub" / "%j"))
    assert str(e.value).startswith(f"--folder {tmp_path / 'link' / 'sub' / '%j'}: lies under {tmp_path / 'link'}, "
                                   f"which is a link to {tmp_path / 'gone'}, which does not exist, not a folder; ")
    check_submit_folder(str(tmp_path / "new" / "%j"))  # a folder to be made: fine


def test_after_leaves_the_parameters_it_was_given():
    """after() gives a new job's parameters; the ones given stay a job without a dependency, as the launcher reuses
    them for the jobs that follow (LS14: the dependency written into them)."""
    params = {"job_name": "cpt", "additional_parameters": {"requeue": True}}
    assert after(params, "7") == {"job_name": "cpt", "additional_parameters": {
        "requeue": True, "dependency": "afterok:7", "kill_on_invalid_dep": "yes"}}
    assert params == {"job_name": "cpt", "additional_parameters": {"requeue": True}}


# mutation audit round 9

SILENT_REFUSAL = ("if name in os.environ.get('FAKE_SBATCH_SILENT', '').split(','):\n"
                  "    sys.exit(3)\n")


def test_sbatch_refusing_without_a_word_is_said_by_its_exit_status(fake_sbatch, tmp_path, token_data, capsys,
                                                                   monkeypatch):
    """sbatch that exits 3 and prints nothing: the line gives its exit status (LS3: 'exit None')."""
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(sbatch.read_text().replace("failed = name in", SILENT_REFUSAL + "failed = name in", 1))
    monkeypatch.setenv("FAKE_SBATCH_SILENT", "cpt")
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(tmp_path / "s" / "%j"),
                        *TINY, f"data.prefix={token_data}", f"checkpoint.dir={tmp_path / 'cpt'}"]) == 1
    assert capsys.readouterr().err.splitlines() == ["error: sbatch refused the cpt job (exit 3); nothing launched"]


def test_a_full_submit_folder_leaves_the_empty_files_that_were_there(fake_sbatch, small_disk, tmp_path,
                                                                     token_data, capsys):
    """--folder on a full disk, where another launch's pickle is still empty (between its open and its write, the
    default --folder being shared): our empty pickle is removed, that one is not (LS2: every empty pickle under a
    uuid name removed)."""
    logs = small_disk / "logs"
    logs.mkdir()
    other = logs / f"{'ab' * 16}.pkl"
    other.write_bytes(b"")
    with open(small_disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 4096)
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(logs / "%j"), *TINY,
                        f"data.prefix={token_data}", f"checkpoint.dir={tmp_path / 'cpt'}"]) == 1
    assert "cannot write submitit's files for the cpt job there (No space left on device)" in capsys.readouterr().err
    assert [p.name for p in logs.iterdir()] == [other.name]


def test_a_refused_job_leaves_another_launchs_files(refusing_sbatch, tmp_path, token_data, capsys, monkeypatch):
    """The first job refused, in a --folder where another launch's pickle and script lie between its sbatch and
    their move (the default --folder is shared): those stay, only ours go (LS11: every pickle and script under a
    uuid name removed)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    theirs = [mine / f"{'cd' * 16}.pkl", mine / f".submission_file_{'ef' * 16}.sh"]
    for path in theirs:
        path.write_text("# megatron_ext submission of another launch\n")
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "cpt")
    assert launch.main(["--recipe", "recipes/tiny/cpt.yaml", "--time", "30", "--folder", str(mine / "%j"), *TINY,
                        f"data.prefix={token_data}", f"checkpoint.dir={tmp_path / 'cpt'}"]) == 1
    assert capsys.readouterr().err.endswith("; nothing launched\n")
    assert sorted(mine.iterdir()) == sorted(theirs)
