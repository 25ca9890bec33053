"""slurm/pipeline.sh: convert -> CPT -> SFT, then NIAH, RULER and the export each after the last training stage, chained
with afterok (dry run: no cluster needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.slurm.conftest import job_env


def pipeline(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), *args], capture_output=True, text=True,
                          env=job_env(**{"SBATCH_ARGS": "--account=proj", **env}), timeout=120)


def test_dry_run_chains_four_jobs_with_afterok():
    proc = pipeline("--dry-run", "--hf", "/models/Llama-3.1-8B-Instruct", "--export", "out/ultralong_1m",
                    "train.steps=10")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    convert, cpt, sft, export = lines
    assert all(line.startswith("sbatch --parsable --account=proj") for line in (convert, export))
    # in sbatch's environment: the recipes checked here, not a RECIPE the submitting shell exported
    assert cpt.startswith("RECIPE=recipes/cpt_1m.yaml sbatch --parsable --account=proj")
    assert sft.startswith("RECIPE=recipes/sft.yaml sbatch --parsable --account=proj")
    assert "--dependency" not in convert and "to-megatron" in convert
    assert "checkpoints/llama31_8b_instruct" in convert  # cpt_1m's checkpoint.init_from (from the recipe)
    assert "--dependency=afterok:\\<convert\\>" in cpt and "slurm/cpt_1m.sh train.steps=10" in cpt
    assert "--dependency=afterok:\\<cpt_1m\\>" in sft and "checkpoint.init_from=checkpoints/cpt_1m" in sft
    assert "--dependency=afterok:\\<sft\\>" in export and "checkpoints/sft_1m" in export and "to-hf" in export
    # a failed job cancels the ones after it instead of leaving them pending forever
    assert "--kill-on-invalid-dep" not in convert
    assert all("--dependency=afterok:\\<" in job and "--kill-on-invalid-dep=yes" in job for job in (cpt, sft, export))


def test_bad_override_fails_at_submission():
    proc = pipeline("--dry-run", "train.bogus=1")
    assert proc.returncode != 0 and "bogus" in proc.stderr
    assert proc.stdout == ""  # validated before the first submission


def test_niah_job_evaluates_the_last_stage_at_the_cpt_layout():
    proc = pipeline("--dry-run", "--niah", "128K:1M:4", "--export", "out/ultralong_1m")
    assert proc.returncode == 0, proc.stderr
    cpt, sft, niah, export = proc.stdout.splitlines()
    tp = subprocess.run([sys.executable, "-m", "megatron_ext.launch", "--recipe", "recipes/cpt_1m.yaml", "--get",
                         "parallel.tensor"], capture_output=True, text=True, cwd=ROOT, env=job_env()).stdout.strip()
    cp = subprocess.run([sys.executable, "-m", "megatron_ext.launch", "--recipe", "recipes/cpt_1m.yaml", "--get",
                         "parallel.context"], capture_output=True, text=True, cwd=ROOT, env=job_env()).stdout.strip()
    ranks = int(tp) * int(cp)
    assert "--dependency=afterok:\\<sft\\>" in niah and "slurm/niah.sh --megatron checkpoints/sft_1m" in niah
    assert f"--tp {tp} --cp {cp} --lengths 128K:1M:4" in niah and "--chat" in niah
    assert f"--nodes={-(-ranks // min(ranks, 8))} --ntasks-per-node={min(ranks, 8)}" in niah
    assert "--out checkpoints/sft_1m_niah" in niah
    assert "--dependency=afterok:\\<sft\\>" in export  # not on the evaluation: a failed one does not cancel it


def test_ruler_job_after_the_niah_job_and_bad_lengths_fail_before_submitting():
    proc = pipeline("--dry-run", "--niah", "1M", "--ruler", "128K,1M", "--export", "out/ultralong_1m")
    assert proc.returncode == 0, proc.stderr
    cpt, sft, niah, ruler, export = proc.stdout.splitlines()
    assert "--dependency=afterok:\\<sft\\>" in ruler and "--job-name=ruler" in ruler
    assert "slurm/niah.sh ruler --megatron checkpoints/sft_1m --tp 8 --cp 4 --lengths 128K\\,1M --tasks all" in ruler
    assert "--out checkpoints/sft_1m_ruler" in ruler and "--chat" in ruler
    assert "--dependency=afterok:\\<sft\\>" in export
    for option in ("--niah", "--ruler"):
        bad = pipeline("--dry-run", option, "1Q")
        assert bad.returncode == 1 and bad.stdout == ""
        assert bad.stderr.strip() == (f"error: {option} '1Q': '1Q' is not a token count; use e.g. 4096, 32K, 1M "
                                      "(K=1024), a list 1K,2K,4K, or a log-spaced range START:END:COUNT like 1K:1M:11; "
                                      "nothing launched")
    far = pipeline("--dry-run", "--ruler", "1M,2M")  # beyond the SFT model's 1M positions
    assert far.returncode == 1 and far.stdout == ""
    assert "2,097,152 tokens is beyond the last stage's model.max_position_embeddings = 1,048,576" in far.stderr


@pytest.mark.parametrize("crash, said, before", [
    ('exec "$real" -c "raise KeyError(\'bug\')"', "failed with exit 1; its output is above", "KeyError: 'bug'"),
    ("kill -9 $$", "was killed by SIGKILL (exit 137)", None),  # e.g. out of memory: nothing printed
])
def test_a_python_step_that_crashes_ends_in_one_error_line(tmp_path, crash, said, before):
    """A crash of the python the pipeline runs (a bug, not a user error: here in its first recipe read) left a bare
    traceback, or nothing at all when the process was killed; now its output, then one line naming the step."""
    python = tmp_path / "crashing_python"
    python.write_text(f'#!/bin/bash\nreal={sys.executable}\n'
                      f'[[ $1 == -c ]] && exec "$real" "$@"  # the dependency check\n{crash}\n')
    python.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "slurm/pipeline.sh"), "--dry-run"], capture_output=True, text=True,
                          env=job_env(PYTHON=str(python)), timeout=60)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1] == (f"error: reading checkpoint.dir from recipes/cpt_1m.yaml ({python} -m megatron_ext.launch) "
                         f"{said}; nothing launched"), proc.stderr
    if before:
        assert lines[0] == "Traceback (most recent call last):" and lines[-2] == before, proc.stderr
    else:
        assert len(lines) == 1, proc.stderr


def test_an_option_among_the_overrides_is_one_line():
    """`-x` went to the recipe read as an override: argparse's usage (5 lines) and its error."""
    proc = pipeline("--dry-run", "-x")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: unknown option -x (see --help); nothing launched"]


@pytest.mark.parametrize("args, env, message", [
    (["--export"], {}, "error: --export needs a value (see --help)"),
    (["--cpt", "cpt_9m"], {}, "error: --cpt cpt_9m: no slurm/cpt_9m.sh (cpt_1m, cpt_2m, cpt_4m)"),
    ([], {"PYTHON": "/no/such/python"}, "error: PYTHON=/no/such/python: no such program; run with PYTHON="),
    ([], {"PYTHON": "false"}, "error: PYTHON=false cannot import torch, megatron.core and yaml"),
    (["train.bogus=1"], {}, "error: train.bogus: unknown key; valid keys here: "),  # the recipe read's own line
])
def test_an_error_before_the_first_sbatch_says_nothing_was_launched(args, env, message):
    """The sbatch scripts' preflight errors end in '; nothing launched' (slurm/common.sh); the pipeline's, all before
    its first sbatch, did not."""
    proc = pipeline("--dry-run", *args, **env)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message) and lines[0].endswith("; nothing launched"), proc.stderr


def test_a_refused_sbatch_says_what_was_submitted(slurm_cluster, token_data, tmp_path):
    """sbatch refusing a job ended the pipeline with sbatch's own lines (set -e), saying neither that nothing was
    launched nor, after the first job, which jobs were queued anyway. On the local cluster (no GPUs): the first sbatch
    refused (no such partition), then the second (the convert job is held and cancelled; the CPT job asks for its
    script's 8 GPUs per node)."""
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.recipe import load_recipe

    data = f"data.prefix={token_data}"
    # the jobs' size overridden to fit (held: they never run); CPU nodes: 0 GPUs and a CPU recipe
    size = "--hold --nodes=1 --ntasks-per-node=1 --cpus-per-task=1 --mem=100M"
    cpu = ["runtime.device=cpu", "parallel.sequence_parallel=false"]
    proc = pipeline("--no-sft", data, *cpu, SBATCH_ARGS=f"{size} --gpus-per-node 0 --partition=nosuch")
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [
        "error: sbatch refused the cpt_1m job (invalid partition specified: nosuch; Batch job submission failed: "
        "Invalid partition name specified); nothing launched"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_from_recipe(load_recipe(ROOT / "recipes/cpt_1m.yaml", [data]))))
    proc = pipeline("--no-sft", "--hf", str(hf), data, f"checkpoint.init_from={tmp_path}/converted", SBATCH_ARGS=size)
    convert = [line.rpartition(" ")[2] for line in proc.stderr.splitlines() if line.startswith("submitted convert: job ")]
    try:
        assert proc.returncode == 1 and len(convert) == 1, proc.stderr
        assert proc.stderr.splitlines()[-1] == (
            "error: sbatch refused the cpt_1m job (Invalid generic resource (gres) specification); submitted before it: "
            f"convert (job {convert[0]}), which Slurm runs as submitted: scancel {convert[0]} to cancel them"), proc.stderr
    finally:
        for job in convert:
            subprocess.run(["scancel", job], check=False)
