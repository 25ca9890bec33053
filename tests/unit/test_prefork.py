"""tests/prefork.py, the tests' launcher of ranks: a forked rank sees and does what `python -u` would (the oracle: the
same command as a plain subprocess), and its exit code reaches the test, so a failing rank fails it."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import CUDA, ROOT, _run_ranks

PROBE = ROOT / "tests/unit/prefork_probe.py"
pytestmark = pytest.mark.skipif(CUDA, reason="where CUDA is, the tests start plain processes (tests/conftest.py)")


def _both(monkeypatch, cmd: list[str], nproc: int) -> tuple[tuple, tuple]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    forked = _run_ranks(cmd, nproc, env, timeout=120)
    monkeypatch.setenv("MEGATRON_EXT_PREFORK", "0")
    plain = _run_ranks(cmd, nproc, dict(env, MEGATRON_EXT_PREFORK="0"), timeout=120)
    return forked, plain


@pytest.mark.parametrize("program", [[str(PROBE)], ["-m", "tests.unit.prefork_probe"]], ids=["script", "module"])
def test_forked_ranks_see_what_python_would_show_them(monkeypatch, program):
    cmd = [sys.executable, "-u", *program, "ok"]
    (codes, out, err), (plain_codes, plain_out, plain_err) = _both(monkeypatch, cmd, 2)
    assert codes == plain_codes == [0, 0]
    seen, plain_seen = ([json.loads(line) for line in sorted(text.splitlines()) if line.startswith("{")]
                        for text in (out, plain_out))
    assert seen == plain_seen and [s["ranks"] for s in seen] == [["0", "0", "2"], ["1", "1", "2"]]
    assert seen[0]["argv"][0] == str(PROBE) and seen[0]["unbuffered"] and seen[0]["main_file"] == str(PROBE)
    assert sorted(out.splitlines()) == sorted(plain_out.splitlines())  # the atexit handlers ran
    assert sorted(err.splitlines()) == sorted(plain_err.splitlines()) == ["stderr of rank 0", "stderr of rank 1"]


@pytest.mark.parametrize("mode, code", [("exit", 3), ("raise", 1), ("kill", -9)])
def test_a_rank_that_fails_reports_its_exit_code(monkeypatch, mode, code):
    cmd = [sys.executable, "-u", str(PROBE), mode, "3"]
    (codes, out, err), (plain_codes, _, plain_err) = _both(monkeypatch, cmd, 1)
    assert codes == plain_codes == [code]
    if mode == "raise":  # the traceback, as the interpreter prints it
        assert err.splitlines()[-1] == plain_err.splitlines()[-1] == "ValueError: the probe's error"
        assert "Traceback (most recent call last)" in err
    assert ("atexit of rank None" in out) == (mode != "kill")


def test_ranks_that_fail_after_another_report_their_own_exit_code(monkeypatch):
    """Ranks that see a shared user error exit with its code, not all at once: on a busy machine the harness killed
    rank 1 as soon as rank 0 had failed, and a test expecting [1, 1] read [1, -9] (CI, 2026-12-03)."""
    cmd = [sys.executable, "-u", str(PROBE), "exit-by-rank", "3"]
    (codes, _, _), (plain_codes, _, _) = _both(monkeypatch, cmd, 2)
    assert codes == plain_codes == [3, 3]


def test_a_rank_left_waiting_after_another_failed_is_killed(monkeypatch):
    """A rank that waits for one that failed (a collective it never joins) is killed after the grace period."""
    import tests.conftest

    monkeypatch.setattr(tests.conftest, "RANK_EXIT_GRACE_S", 1.0)
    cmd = [sys.executable, "-u", str(PROBE), "hang-after-rank0", "3"]
    (codes, _, _), (plain_codes, _, _) = _both(monkeypatch, cmd, 2)
    assert codes == plain_codes == [3, -9]


def test_a_pid_handed_out_again_does_not_inherit_an_old_exit_code():
    """pid_max is 32768 here: over a whole suite the server's children wrap around, and a new rank that got an
    earlier one's pid read that rank's exit code (0) at once: CI saw a kill -9 reported as 0."""
    from tests.prefork import Prefork

    client = Prefork.__new__(Prefork)  # the message bookkeeping alone, no server
    client.codes, client._buffer = {123: 0, 5: 0}, b'{"pid": 123}\n{"pid": 5}\n{"exit": 5, "code": -9}\n'
    client._messages()
    assert 123 not in client.codes and client.codes[5] == -9  # the new pid 5 ended (killed) in the same batch
