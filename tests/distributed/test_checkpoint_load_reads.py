"""Loading a checkpoint costs the file system O(files), not O(ranks x files): rank 0 alone opens every shard to
check that the checkpoint is complete and tells the others; each rank reads the torch_dist index (`.metadata`)
once itself, plus torch's own read inside the load. A checkpoint that lost a shard still fails on every rank with
rank 0's message. At 512 ranks a torch_dist checkpoint has ~1,000 files: every rank opened them all at each
requeue, and read `.metadata` 3-4 times."""

from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/checkpoint_load_reads.py"


def test_rank_zero_alone_checks_the_files_and_every_rank_raises_its_message(tmp_path, torchrun):
    torchrun(WORKER, 2, "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "result"))
    ranks = [read_json(tmp_path / f"result.{rank}.json") for rank in (0, 1)]
    for mode in ("resume", "weights_only"):
        assert [r[mode]["check_complete"] for r in ranks] == [1, 0], (mode, ranks)
        # rank 1: ours (allow-listed, before torch unpickles it) and torch's own in dist_checkpointing.load (was 3-4);
        # rank 0 reads it once more, in the check
        metadata_reads = [r[mode]["opens"][".metadata"] for r in ranks]
        assert metadata_reads[1] <= 2 and metadata_reads[0] <= 3, (mode, metadata_reads)
        assert ranks[1][mode]["opens"]["common.pt"] <= 2, (mode, ranks)  # ours and torch's (was 3-4)
    message = ranks[0]["incomplete"]
    assert message is not None and "iter_0000001: incomplete checkpoint: __" in message and "is missing" in message
    assert ranks[1]["incomplete"] == message
