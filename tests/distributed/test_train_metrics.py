"""The metrics' `memory_gib` is the largest over the ranks: the rank holding the most runs out first."""

import json

WORKER = '''
import json
import sys
from pathlib import Path

import psutil
import torch

from megatron_ext.runtime import destroy_distributed, init_distributed
from megatron_ext.train_metrics import memory_gib

init_distributed("cpu")
rank = torch.distributed.get_rank()
held = torch.ones(2**28) if rank == 1 else None  # 1 GiB, on rank 1 only
own = psutil.Process().memory_info().rss / 2**30
reported = memory_gib()
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"own": own, "reported": reported}))
destroy_distributed()
'''


def test_memory_is_the_largest_over_ranks(tmp_path, torchrun):
    script = tmp_path / "memory_worker.py"
    script.write_text(WORKER)
    torchrun(script, 2, str(tmp_path))  # each rank writes its numbers (their printed lines can interleave)
    rows = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert rows[1]["own"] > rows[0]["own"] + 0.9  # the 1 GiB is rank 1's
    assert rows[0]["reported"] == rows[1]["reported"]  # the same number on every rank (rank 0 writes it)
    assert abs(rows[0]["reported"] - rows[1]["own"]) < 0.05
