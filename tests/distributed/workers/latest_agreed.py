"""Worker: every rank resumes the iteration rank 0 finds, whatever its own view of the folder.

    torchrun --nproc_per_node=2 latest_agreed.py DIR

DIR/rank0 has a latest pointer at 5, DIR/rank1 none (a node whose view of a shared file system lags): each rank
looks at its own folder and prints what it agreed on; then rank 0's pointer is garbage and each rank prints the
error it raised (rank 1 used to wait in the broadcast for ever, or start over).
"""

import sys
from pathlib import Path

import torch

from megatron_ext.checkpoint_index import CheckpointError
from megatron_ext.resume import agreed_latest_iteration
from megatron_ext.runtime import destroy_distributed, init_distributed

init_distributed("cpu")
rank = torch.distributed.get_rank()
mine = Path(sys.argv[1]) / f"rank{rank}"
# one write per line (see stop_agreed.py)
print(f"rank {rank} agreed {agreed_latest_iteration(mine)}\n", end="", flush=True)
torch.distributed.barrier()
if rank == 0:
    (mine / "latest_checkpointed_iteration.txt").write_text("garbage")
torch.distributed.barrier()
try:
    agreed_latest_iteration(mine)
except CheckpointError as e:
    print(f"rank {rank} error {'expected an iteration number' in str(e)}\n", end="", flush=True)
destroy_distributed()
