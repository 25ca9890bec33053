"""A Ctrl-C once a tool's outcome is said, while Python exits (torch's and Megatron-Core's teardown take a second),
ended a complete run with a KeyboardInterrupt traceback or status -2. Each tool's script ignores interrupts after
main() returns (not main() itself: tests call it in-process, and a test session that ignored SIGINT and SIGTERM
would pass that on to every process it starts). prepare_data's own test: test_data_errors.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.test_convert_fixtures import make_hf_model
from tests.unit.test_evaluate import save_tiny


def _exits_slowly(tool: str, argv: list[str]) -> str:
    """Python that runs tools/TOOL as its script with `argv`; its sys.exit says 'returned' and waits 3 s first."""
    return ("import runpy, sys, time\n"
            f"sys.argv = [{tool!r}, *{argv!r}]\n"
            "real_exit = sys.exit\n"
            "def exit_slowly(code=0):\n"
            "    print('returned', flush=True)\n"
            "    time.sleep(3)  # Python's exit, made long enough to be hit\n"
            "    real_exit(code)\n"
            "sys.exit = exit_slowly\n"
            f"runpy.run_path({str(ROOT / 'tools' / tool)!r}, run_name='__main__')\n")


@pytest.mark.parametrize("tool", ["niah.py", "convert.py"])
def test_ctrl_c_after_the_outcome_changes_nothing(tool, tmp_path):
    """Control (old scripts): a KeyboardInterrupt traceback, exit 1."""
    if tool == "niah.py":
        argv = ["--model", str(save_tiny(tmp_path / "hf")), "--lengths", "64", "--depths", "50", "--no-progress",
                "--out", str(tmp_path / "out")]
        made = tmp_path / "out" / "results.json"
    else:
        argv = ["to-megatron", "--hf", str(make_hf_model(tmp_path / "hf")), "--out", str(tmp_path / "out"),
                "--no-progress"]
        made = tmp_path / "out" / "latest_checkpointed_iteration.txt"
    proc = subprocess.Popen([sys.executable, "-c", _exits_slowly(tool, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            # SIGINT as a terminal leaves it: CI runs the tests in the background, where it is
                            # ignored, and the tool's Python would then install no Ctrl-C handler at all
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if line == "returned\n":
                break
        else:
            pytest.fail(f"{tool} ended without returning: {proc.communicate()}")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert Path(made).is_file()
