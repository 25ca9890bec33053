"""A tool (tools/NAME) run in a process of its own and signalled at a chosen moment, not after a chosen delay: held
at its first import of a module (torch's C++ set-up, where an interrupt could abort), or in its exit once main()
has returned. The signal goes to the process group, as a terminal's Ctrl-C does.

SIGINT is reset in the child, as a terminal leaves it: the suite runs in the background in CI, where SIGINT is
ignored, and a tool's Python then installs no Ctrl-C handler at all (such a test passes or fails by doing nothing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT

# Held at its first import of the module the second argument names until the file the third names exists; the first
# is a file it makes once held, the fourth one it makes if an interrupt is raised inside that import.
_HELD_AT_IMPORT = """
import runpy, sys, time
from pathlib import Path

held, name, go, raised = (sys.argv.pop(1) for _ in range(4))
held, go, raised = Path(held), Path(go), Path(raised)


class HoldImport:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == name:
            sys.meta_path.remove(self)
            held.touch()
            try:
                while not go.exists():
                    time.sleep(0.01)
            except KeyboardInterrupt:
                raised.touch()
                raise
        return None


sys.meta_path.insert(0, HoldImport())
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# Its sys.exit (once main() returned) says 'returned' on stdout and waits 3 s: Python's exit, made long enough to hit.
_EXITS_SLOWLY = """
import runpy, sys, time

real_exit = sys.exit


def exit_slowly(code=0):
    print("returned", flush=True)
    time.sleep(3)
    real_exit(code)


sys.exit = exit_slowly
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _start(script: str, tool: str, args: list) -> subprocess.Popen:
    # `python -c` makes sys.argv[0] '-c': the script puts the tool's path there before running it
    code = f"import sys\nsys.argv[0] = {str(ROOT / 'tools' / tool)!r}\n" + script
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, err


def signalled_at_import(tool: str, module: str, argv: list, sig: signal.Signals, flags: Path) -> tuple[int, str, bool]:
    """tools/TOOL ARGV, held at its first import of `module`, sent `sig` there, then let go: (exit status, stderr,
    whether the interrupt was raised inside that import). `flags`: an empty folder for the hand-over files."""
    held, go, raised = flags / "held", flags / "go", flags / "raised"
    proc = _start(_HELD_AT_IMPORT, tool, [held, module, go, raised, *argv])
    deadline = time.time() + 120
    while not held.exists():
        if proc.poll() is not None or time.time() > deadline:
            code, err = _finish(proc)
            raise AssertionError(f"never held at the import of {module} (exit {code}): {err[-3000:]}")
        time.sleep(0.01)
    os.killpg(proc.pid, sig)
    go.touch()
    code, err = _finish(proc)
    return code, err, raised.exists()


def ctrl_c_in_the_exit(tool: str, argv: list) -> tuple[int, str]:
    """tools/TOOL ARGV, sent Ctrl-C once main() has returned, while it exits: (exit status, stderr)."""
    proc = _start(_EXITS_SLOWLY, tool, argv)
    for line in proc.stdout:
        if line == "returned\n":
            break
    else:
        code, err = _finish(proc)
        raise AssertionError(f"{tool} ended without returning from main() (exit {code}): {err[-3000:]}")
    os.killpg(proc.pid, signal.SIGINT)
    return _finish(proc)
