"""SIGTERM reaches a tool's cleanup as on Ctrl-C (megatron_ext.runtime.signals)."""

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import contextlib, signal, sys, time
from pathlib import Path
from megatron_ext.runtime.signals import sigterm_as_interrupt
tmp = Path(sys.argv[1]) / ".out.partial"
tmp.mkdir()
with sigterm_as_interrupt() if sys.argv[2] == "on" else contextlib.nullcontext():
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        tmp.rmdir()
"""


def _run(tmp_path, mode):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "ready"
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


def test_sigterm_runs_the_cleanup(tmp_path):
    code, err = _run(tmp_path, "on")
    assert code != 0 and "Terminated: received signal SIGTERM" in err
    assert not (tmp_path / ".out.partial").exists()


def test_control_default_sigterm_leaves_the_temporary_folder(tmp_path):
    code, _ = _run(tmp_path, "off")
    assert code == -15 and (tmp_path / ".out.partial").is_dir()


def test_the_previous_disposition_comes_back_and_other_handlers_stay():
    """Tools run in-process (tests, submitit's evaluation stages) leave SIGTERM as they found it."""
    import signal

    from megatron_ext.runtime.signals import sigterm_as_interrupt

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with sigterm_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def theirs(signum, frame):
        pass

    signal.signal(signal.SIGTERM, theirs)
    try:
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
