"""`checkpoint.fully_parallel_load`: the replicas of a DP 2 run share the reading of a checkpoint (each reads about
half of the weights, which they then exchange) and get the whole state back exactly; read by every rank in full,
each reads all of them (the control). The trainer's resume with it: tests/distributed/test_train_resume_layout.py."""

from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/parallel_load.py"


def test_replicas_share_the_reading_and_restore_the_state_exactly(tmp_path, torchrun):
    torchrun(WORKER, 2, "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "result"))
    ranks = [read_json(tmp_path / f"result.{rank}.json") for rank in (0, 1)]
    weights = ranks[0]["weight_bytes"]
    for r in ranks:
        for mode in ("all", "fully_parallel"):
            assert r[mode]["mismatched"] == [] and r[mode]["tensors"] > 20, (mode, r[mode])
    every = [r["all"]["bytes_read"] for r in ranks]
    shared = [r["fully_parallel"]["bytes_read"] for r in ranks]
    # Read in full, each rank reads the weights and its own optimizer slice; sharing, the weights are read once in
    # all (the items' bytes hold a little serialisation overhead beyond the tensors').
    assert all(b > weights for b in every), (every, weights)
    assert abs(sum(every) - sum(shared) - weights) < 0.1 * weights, (every, shared, weights)
    for full, part in zip(every, shared):
        assert abs(part - (full - weights / 2)) < 0.15 * weights, (every, shared, weights)
