"""sbatch slurm/niah.sh on the local 2-node Slurm cluster: the Megatron evaluation engine with one Slurm task per
rank (CP 2 across the two nodes) writes what torchrun on this machine writes."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, read_json
from tests.slurm.conftest import NODES, TASKS_PER_NODE, job_env, sbatch

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
             "--out", str(tmp_path / "torchrun"), *ARGS)
    proc = sbatch("niah.sh", "--megatron", str(checkpoint / "mc"), "--out", str(tmp_path / "sbatch"), *ARGS,
                  out=tmp_path / "job.log")
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "Megatron engine: TP 1 x PP 1 x CP 2, DP 1 (2 ranks" in log and "evaluation exited with 0" in log
    ours, ref = read_json(tmp_path / "sbatch/results.json"), read_json(tmp_path / "torchrun/results.json")
    assert [c["output"] for c in ours["cells"]] == [c["output"] for c in ref["cells"]]
    assert ours["scores"] == ref["scores"] and len(ours["cells"]) == 4


def test_sbatch_niah_user_error_is_one_line(slurm_cluster, checkpoint, tmp_path):
    proc = sbatch("niah.sh", "--megatron", str(checkpoint / "mc"), "--cp", "4", "--out", str(tmp_path / "o"),
                  out=tmp_path / "job.log", env=job_env())
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode != 0
    assert log.count("error: --tp 1 x --pp 1 x --cp 4 must divide the 2 processes") == 1, log[-3000:]
    assert "Traceback" not in log
