"""Every shell script passes `bash -n` and shellcheck; shellcheck is shown to catch a real mistake."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT

SCRIPTS = sorted([*ROOT.glob("slurm/*.sh"), *ROOT.glob("tests/slurm/*.sh"), ROOT / "tests/run.sh"])


def test_scripts_found():
    names = {p.name for p in SCRIPTS}
    assert {"common.sh", "cpt_1m.sh", "cpt_2m.sh", "cpt_4m.sh", "sft.sh", "pipeline.sh", "local_cluster.sh",
            "run.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def shellcheck(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install -y shellcheck)")
    return subprocess.run(["shellcheck", "--external-sources", *args], capture_output=True, text=True, cwd=ROOT)


def test_shellcheck_clean():
    proc = shellcheck(*[str(p.relative_to(ROOT)) for p in SCRIPTS])
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_shellcheck_catches_unquoted_variable(tmp_path):
    """Negative control: the check above can fail."""
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nrm -rf $1/build\n')
    proc = shellcheck(str(bad))
    assert proc.returncode != 0 and "SC2086" in proc.stdout


def test_local_cluster_says_why_it_cannot_run_without_root():
    """The skip path: not root -> exit 2 and a reason (what the Slurm tests then skip with)."""
    import os

    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to try the script as an unprivileged user")
    proc = subprocess.run(["runuser", "-u", "nobody", "--", "bash", str(ROOT / "tests/slurm/local_cluster.sh"),
                           "start"], capture_output=True, text=True, env={"PATH": os.environ["PATH"],
                                                                         "SLURM_LOCAL_DIR": "/tmp/not_used"})
    assert proc.returncode == 2, proc.stderr
    assert "cannot run Slurm here: not root" in proc.stderr


def test_exit_codes_agree_with_the_trainer():
    """slurm/common.sh requeues on EXIT_REQUEUE and explains EXIT_DIVERGED: the same numbers as megatron_ext.train."""
    import re

    from megatron_ext.train import EXIT_DIVERGED, EXIT_REQUEUE

    text = (ROOT / "slurm/common.sh").read_text()
    found = {name: int(value) for name, value in re.findall(r"^(EXIT_\w+)=(\d+)", text, flags=re.M)}
    assert found == {"EXIT_REQUEUE": EXIT_REQUEUE, "EXIT_DIVERGED": EXIT_DIVERGED}
