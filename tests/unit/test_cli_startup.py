"""The command-line tools answer `--help` and argument mistakes without importing torch (2-5 s on this machine:
`tools/convert.py --help` took 4.7 s, `niah.py --help` 2.8 s, `quantize.py --help` 3.5 s; now 0.1-0.3 s).

Each command runs as the user runs it (the script as __main__, in a fresh interpreter); the probe prints which
heavy modules it imported by the time it exited."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "megatron.core")
PROBE = ("import runpy, sys\n"
         "sys.argv = sys.argv[1:]\n"
         "try:\n"
         "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
         "    code = 0\n"
         "except SystemExit as e:  # as the interpreter ends: a message to stderr and 1, None is 0\n"
         "    code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1\n"
         f"print('heavy:', [m for m in {HEAVY!r} if m in sys.modules], 'exit:', code)\n")


def run_tool(*argv: str) -> tuple[str, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return proc.stdout.strip().splitlines()[-1], proc.stderr


@pytest.mark.parametrize("argv", [
    ("tools/convert.py", "--help"), ("tools/convert.py", "to-hf", "--help"),
    ("tools/niah.py", "--help"), ("tools/niah.py", "ruler", "--help"), ("tools/niah.py", "ppl", "--help"),
    ("tools/niah.py", "generate", "--help"), ("tools/quantize.py", "--help"), ("tools/plan.py", "--help"),
    ("tools/checkpoint.py", "info", "--help"), ("tools/prepare_data.py", "cpt", "--help"),
    ("megatron_ext/launch.py", "--help"), ("megatron_ext/launch_eval.py", "--help"),
], ids=" ".join)
def test_help_without_torch(argv):
    last, err = run_tool(*argv)
    assert last.endswith("heavy: [] exit: 0"), (last, err[-2000:])


@pytest.mark.parametrize("argv, code, message", [
    (("tools/niah.py", "--samples", "0", "--model", "m", "--out", "o"), 1, "error: --samples 0:"),
    (("tools/convert.py", "to-hf", "--megatron", "m", "--out", "o", "--max-shard-size-gb", "0"), 1,
     "error: --max-shard-size-gb 0.0: must be a positive number"),
    (("tools/quantize.py", "--hf", "m"), 2, "error: the following arguments are required: --out, --calib"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_argument_mistakes_without_torch(argv, code, message):
    last, err = run_tool(*argv)
    assert last == f"heavy: [] exit: {code}" and message in err, (last, err[-2000:])


def test_the_probe_sees_torch():
    """The control: past the argument checks (here a model folder that is not there), the evaluation imports torch
    and the probe says so."""
    last, err = run_tool("tools/niah.py", "--model", "/no/such/model", "--out", "/tmp/unused")
    assert last.startswith("heavy: ['torch'") and last.endswith("exit: 1"), (last, err)
    assert "model directory /no/such/model does not exist" in err
