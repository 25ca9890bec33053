"""What `tools/niah.py` says and returns when Ctrl-C or SIGTERM (scancel, a Slurm time limit) stops it.

Kept out of cli.py, which holds the commands: a stopped run ends in one line that says what it kept (a NIAH or
RULER sweep saves its grid after every length, so `--resume` goes on from there), not in a traceback, and exits
130 (Ctrl-C) or 143 (SIGTERM), as the shell reports a process the signal ended. The temporary Hugging Face copy
of a --megatron checkpoint and half-written result files are removed by their own `finally` blocks before this runs.
"""

from __future__ import annotations

import sys
import time
from argparse import Namespace
from contextlib import contextmanager
from typing import Iterator

from megatron_ext.runtime.signals import sigterm_as_interrupt

# Where the commands that save as they go keep their grid (cli.py's `save`).
SAVED_AS_THEY_GO = {"niah": "results.json", "ruler": "ruler.json"}


@contextmanager
def interrupts_reported(command: str, args: Namespace) -> Iterator[None]:
    """Within the block SIGTERM is Ctrl-C (`sigterm_as_interrupt`: the `finally` cleanups run); either ends the
    process with `interrupted`'s line and status (SystemExit)."""
    started = time.time()
    try:
        with sigterm_as_interrupt():
            yield
    except KeyboardInterrupt as e:  # after the block: a second signal now stops the process, as it should
        sys.exit(interrupted(command, args, started, e))


def interrupted(command: str, args: Namespace, started: float, e: KeyboardInterrupt) -> int:
    """Print one `error: interrupted ...` line saying what the run of `command` kept, and return its exit status:
    143 for SIGTERM (`Terminated`), 130 for Ctrl-C. `started`: time.time() when the run began, to tell results it
    saved from an earlier run's. Under torchrun every rank gets the signal: rank 0 alone prints."""
    from megatron_ext.runtime import process_env
    from megatron_ext.runtime.signals import Terminated

    how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
    if process_env().rank == 0:
        # _model's TemporaryDirectory removed it as the interrupt left the block
        copy = "; the Hugging Face copy of --megatron was removed" if args.megatron and args.engine == "hf" else ""
        print(f"error: interrupted ({how}); {_kept(command, args, started)}{copy}", file=sys.stderr, flush=True)
    return 143 if isinstance(e, Terminated) else 130


def _kept(command: str, args: Namespace, started: float) -> str:
    name = SAVED_AS_THEY_GO.get(command)
    if name is not None:
        path = args.out / name
        try:
            # 1 s of slack: some file systems keep whole seconds
            saved = path.is_file() and (args.resume or path.stat().st_mtime >= started - 1)
        except OSError:
            saved = False
        if saved:
            return (f"the results so far are saved in {path} (after every length): run the same command with "
                    "--resume to go on")
        return f"no length was finished, nothing was saved in --out {args.out}: run the command again"
    if command == "ppl":
        return f"nothing was written (--out {args.out} gets ppl.json when every document is done): run it again"
    return "nothing was written: run it again" if args.out is not None else "no answer: run it again"
