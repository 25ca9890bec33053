"""Start the tests' worker processes by forking one that has already imported torch and Megatron-Core.

Why: every process the suite starts pays about 3 s of CPU importing torch and Megatron-Core, and about 1 s
tearing the interpreter down, before and after a run of a few seconds; the multi-rank tests start hundreds
of them on a 2-core machine. Here one server process per environment imports those once, and each rank is
a fork of it that runs the same program as `python -u script.py args` or `python -u -m module args` would
(the same `sys.argv`, `sys.path[0]`, environment, working directory and `__main__`), with its output going
to the files given. A rank ends as Python's own exit does (threads joined, `atexit` handlers run, its exit
code or 1 with the traceback) but without the interpreter's teardown, as multiprocessing's forked children
end. Only the tests use it; MEGATRON_EXT_PREFORK=0 turns it off (plain subprocesses). What only a fresh
interpreter shows (a module used but never imported, which the server happened to import) stays covered by the
tests that start real processes: the Slurm jobs, the demo's torchrun runs, the one-process CLI runs.

The server is single-threaded (no thread holds a lock across the fork) and imports nothing that reads the
rank's variables; it is started with the rank's environment less the rendezvous variables, and the client
starts another server when that environment changes.

Protocol, one JSON object per line: the client sends {"argv", "env", "cwd", "stdout", "stderr"}; the server
answers {"pid"} when it has forked and {"exit": pid, "code"} when that child ends (code as Popen.returncode).
The line `quit` (or the end of its input) ends the server and any child still running.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# What the trainer, the converters and the workers import; all of it is import-time code that reads no rank.
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.distributed", "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel",
           "megatron_ext.model", "megatron_ext.runtime", "megatron_ext.train", "megatron_ext.checkpoint")


def enabled() -> bool:
    """False when MEGATRON_EXT_PREFORK=0 asks for plain subprocesses."""
    return os.environ.get("MEGATRON_EXT_PREFORK", "1") != "0"


# ---------------------------------------------------------------------------------------------- the server

def _exit_code(code) -> int:
    """What the interpreter makes of `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(request: dict) -> None:
    """In the forked child: become `python -u <argv>`, run it, and leave as Python would. Never returns."""
    code = 1
    try:
        gc.enable()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # -u: unbuffered binary layer, text written through at once
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                                       errors="backslashreplace")
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        argv = request["argv"]
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in argv[0], as -m does
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:  # noqa: BLE001 - the interpreter's report of an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # as at interpreter exit: wait for the program's non-daemon threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    except BaseException:  # noqa: BLE001 - could not become the program (a bad request): say why, exit 1
        traceback.print_exc()
    finally:
        os._exit(code)


def serve() -> None:
    """Import PRELOAD, then fork a child per request line on stdin until stdin closes."""
    gc.disable()  # no collection between the imports and the freeze: objects stay where they were allocated
    for name in PRELOAD:
        __import__(name)
    # The preloaded objects live as long as any child; frozen, the children's collections skip them instead of
    # walking (and so copying, page by page) the whole inherited heap.
    gc.freeze()
    out = sys.stdout

    def send(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    send({"ready": os.getpid()})
    children: set[int] = set()
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.02)
        if readable:
            chunk = os.read(stdin, 1 << 16)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line == b"quit":
                    break
                pid = os.fork()
                if pid == 0:
                    _run_child(json.loads(line))
                children.add(pid)
                send({"pid": pid})
            if not chunk or b"quit" in lines:  # the client is gone or done: so are its ranks
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# ---------------------------------------------------------------------------------------------- the client

class Prefork:
    """One server, started with `env`; `start` forks a rank, `returncode` says whether it has ended."""

    def __init__(self, env: dict, cwd: Path):
        self.env, self.cwd = env, cwd
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "tests.prefork"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=cwd)
        self.codes: dict[int, int] = {}
        self._buffer = b""
        self._read_until("ready", timeout=300)

    def _messages(self) -> list[dict]:
        """The complete lines read so far; exit codes are kept as they come."""
        lines = self._buffer.split(b"\n")
        self._buffer = lines.pop()
        messages = [json.loads(line) for line in lines]
        for m in messages:  # in order: a pid the system hands out again must not inherit an old child's exit code
            if "pid" in m:  # (pid_max is 32768 here: a whole suite's ranks wrap around, and one reported 0 for -9)
                self.codes.pop(m["pid"], None)
            if "exit" in m:
                self.codes[m["exit"]] = m["code"]
        return messages

    def _read(self, timeout: float) -> bool:
        """Read what the server wrote within `timeout` s; False when it has closed its output."""
        if select.select([self.proc.stdout], [], [], timeout)[0]:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            self._buffer += chunk
            return bool(chunk)
        return True

    def _read_until(self, key: str, timeout: float) -> dict:
        deadline = time.time() + timeout
        while True:
            for message in self._messages():
                if key in message:
                    return message
            remaining = deadline - time.time()
            if remaining <= 0 or not self._read(min(remaining, 0.05)):
                raise RuntimeError(f"the prefork server did not answer (exit {self.proc.poll()})")

    def start(self, argv: list[str], env: dict, stdout: str, stderr: str) -> int:
        """Fork `python -u <argv>` with `env` (the rank's), its output appended to the files `stdout`, `stderr`."""
        request = {"argv": argv, "env": env, "cwd": str(self.cwd), "stdout": stdout, "stderr": stderr}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return self._read_until("pid", timeout=60)["pid"]

    def returncode(self, pid: int) -> int | None:
        """The child's exit code (negative: killed by that signal), None while it runs."""
        while pid not in self.codes and select.select([self.proc.stdout], [], [], 0)[0]:
            if not self._read(0):
                raise RuntimeError(f"the prefork server ended (exit {self.proc.poll()})")
            self._messages()
        return self.codes.get(pid)

    def close(self) -> None:
        """Ask the server to end: it kills any child still running and exits. Said in words rather than by closing
        its input alone, since a process forked from the client since (the CPU backend's checkpoint-results manager,
        in a test that set up Megatron-Core in pytest's process) holds a copy of that pipe: no end of file comes."""
        try:
            self.proc.stdin.write(b"quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # it had died
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    serve()
