"""StopFlag.agreed over two gloo ranks: any rank's signal stops every rank, and only a Ctrl-C somewhere makes it
the interrupted stop (exit 130); stop signals on every rank (scancel signals every task) are still the requeue.
Mutation audit round 6 (megatron_ext.train_stop): one rank cannot tell a MAX from a SUM of the flags."""

from tests.conftest import ROOT


def test_every_rank_agrees_on_the_stop_and_its_kind(torchrun):
    out = torchrun(ROOT / "tests/distributed/workers/stop_agreed.py", 2)
    expect = {"none": (False, False), "sigterm_both": (True, False), "usr1_rank1": (True, False),
              "ctrl_c_both": (True, True), "ctrl_c_rank0_sigterm_rank1": (True, True)}
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert lines == sorted(f"rank {r} {name} stop {stop} interrupted {interrupted}"
                           for r in (0, 1) for name, (stop, interrupted) in expect.items()), out
