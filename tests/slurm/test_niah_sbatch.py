"""sbatch slurm/niah.sh on the local 2-node Slurm cluster: the Megatron evaluation engine with one Slurm task per
rank (CP 2 across the two nodes) writes what torchrun on this machine writes (NIAH) or transformers does (RULER-style
tasks); stopped by the time-limit warning, the job requeues itself and the rerun finishes the grid with --resume."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.conftest import ROOT, read_json
from tests.slurm.conftest import NODES, SBATCH_SIZE, TASKS_PER_NODE, RequeueNow, job_env, sbatch, wait_job

ARGS = ["--cp", "2", "--lengths", "96,160", "--depths", "0,100", "--max-new-tokens", "4", "--no-progress"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, cpu_parallel_state):
    from megatron_ext.convert import to_megatron
    from tests.unit.test_evaluate import save_tiny

    d = tmp_path_factory.mktemp("niah_sbatch")
    save_tiny(d / "hf")
    to_megatron(d / "hf", d / "mc", progress=False)  # records d / "hf" as its tokenizer
    return d


def test_sbatch_niah_matches_torchrun(slurm_cluster, checkpoint, torchrun, tmp_path):
    assert NODES * TASKS_PER_NODE == 2
    torchrun(ROOT / "tools/niah.py", 2, "--megatron", str(checkpoint / "mc"), "--engine", "megatron",
             "--out", str(tmp_path / "torchrun"), *ARGS, launcher="torchrun")
    proc = sbatch("niah.sh", "--megatron", str(checkpoint / "mc"), "--out", str(tmp_path / "sbatch"), *ARGS,
                  out=tmp_path / "job.log")
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "Megatron engine: TP 1 x PP 1 x CP 2, DP 1 (2 ranks" in log and "evaluation exited with 0" in log
    ours, ref = read_json(tmp_path / "sbatch/results.json"), read_json(tmp_path / "torchrun/results.json")
    assert [c["output"] for c in ours["cells"]] == [c["output"] for c in ref["cells"]]
    assert ours["scores"] == ref["scores"] and len(ours["cells"]) == 4


def test_sbatch_ruler_matches_the_hf_engine(slurm_cluster, checkpoint, tmp_path):
    """`sbatch slurm/niah.sh ruler ...`: RULER-style tasks at CP 2 across the two nodes, the outputs of transformers."""
    from megatron_ext.evaluate.cli import main

    args = ["--tasks", "niah_multikey_2,vt", "--lengths", "200", "--samples", "2", "--max-new-tokens", "4",
            "--no-progress"]
    main(["ruler", "--model", str(checkpoint / "hf"), "--out", str(tmp_path / "hf"), *args])
    proc = sbatch("niah.sh", "ruler", "--megatron", str(checkpoint / "mc"), "--cp", "2",
                  "--out", str(tmp_path / "sbatch"), *args, out=tmp_path / "job.log")
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0 and "evaluation exited with 0" in log, log[-4000:]
    ours, ref = read_json(tmp_path / "sbatch/ruler.json"), read_json(tmp_path / "hf/ruler.json")
    assert [c["output"] for c in ours["cells"]] == [c["output"] for c in ref["cells"]] and len(ours["cells"]) == 4
    assert ours["settings"]["layout"]["context"] == 2 and "| **average** |" in log


def test_sbatch_niah_user_error_is_one_line(slurm_cluster, checkpoint, tmp_path):
    proc = sbatch("niah.sh", "--megatron", str(checkpoint / "mc"), "--cp", "4", "--out", str(tmp_path / "o"),
                  out=tmp_path / "job.log", env=job_env())
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode != 0
    assert log.count("error: --tp 1 x --pp 1 x --cp 4 must divide the 2 processes") == 1, log[-3000:]
    assert "Traceback" not in log


def test_usr1_requeues_and_the_rerun_resumes(slurm_cluster, checkpoint, tmp_path):
    from megatron_ext.evaluate.cli import main

    out, log = tmp_path / "o", tmp_path / "job.log"
    grid = ["--cp", "2", "--lengths", "128,512,1024,2048", "--depths", "0:100:10", "--max-new-tokens", "4", "--force",
            "--no-progress"]
    with RequeueNow() as requeue:
        cmd = ["sbatch", "--parsable", *SBATCH_SIZE, f"--output={log}", str(ROOT / "slurm/niah.sh"),
               "--megatron", str(checkpoint / "mc"), "--out", str(out), *grid]
        job_id = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                                env=job_env()).stdout.strip().split(";")[0]
        deadline = time.time() + 300
        while not (out / "results.json").exists():  # the first length is done and saved
            assert time.time() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
            time.sleep(0.05)
        # What Slurm does at --signal=B:USR1@300 before the time limit: USR1 to the batch shell only.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        state, exit_code = wait_job(job_id)
    text = log.read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), text[-4000:]
    assert "received USR1: stopping the evaluation" in text and f"requeueing job {job_id} (restart 1)" in text
    assert f"job {job_id} (niah) restart 1" in text and job_id in requeue.released
    assert " of 44 cells kept from the earlier run" in text, "the requeued job did not resume:\n" + text[-3000:]
    kept = int(text.split(" of 44 cells kept from the earlier run")[0].rsplit(" ", 1)[1])
    assert 11 <= kept < 44, f"USR1 arrived after {kept} cells; the grid must be longer"
    ours = read_json(out / "results.json")
    assert len(ours["cells"]) == 44 and all(c["score"] is not None for c in ours["cells"])
    # the same grid in one go on the transformers engine
    main(["--model", str(checkpoint / "hf"), "--out", str(tmp_path / "hf"), *grid[2:]])
    ref = read_json(tmp_path / "hf/results.json")
    key = lambda c: (c["length"], c["depth"])  # noqa: E731
    for a, b in zip(sorted(ref["cells"], key=key), sorted(ours["cells"], key=key)):
        assert (a["length"], a["depth"], a["value"]) == (b["length"], b["depth"], b["value"])
        assert a["output"].startswith(b["output"])
    assert ours["scores"] == ref["scores"]
