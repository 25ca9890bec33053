"""Run by tests/unit/test_prefork.py, as a script and as a module, forked by tests/prefork.py and as a plain
`python -u`: prints what the program sees, then ends the way its first argument says."""

import atexit
import json
import os
import signal
import sys
import time


def main() -> None:
    mode = sys.argv[1]
    seen = {"argv": sys.argv, "path0": sys.path[0], "main_file": sys.modules["__main__"].__file__,
            "cwd": os.getcwd(), "ranks": [os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")],
            "unbuffered": sys.stdout.write_through}
    # one write per line (print writes the newline apart): the ranks share one output file
    sys.stdout.write(json.dumps(seen) + "\n")
    sys.stderr.write(f"stderr of rank {os.environ.get('RANK')}\n")
    atexit.register(sys.stdout.write, f"atexit of rank {os.environ.get('RANK')}\n")
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "exit-by-rank":  # rank r exits r x 2 s after rank 0, as ranks slow to see a shared error do
        time.sleep(2 * int(os.environ.get("RANK") or 0))
        sys.exit(int(sys.argv[2]))
    if mode == "hang-after-rank0":  # the others wait forever, as in a collective rank 0 never joins
        if os.environ.get("RANK") not in (None, "0"):
            time.sleep(3600)
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise ValueError("the probe's error")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
