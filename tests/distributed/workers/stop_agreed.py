"""Worker: what every rank agrees on at the end of a step, for signals that reached some ranks.

    torchrun --nproc_per_node=2 stop_agreed.py

Each case gives each rank its signals (called as Python calls a handler: Ctrl-C in the training loop), then every
rank prints what `StopFlag.agreed()` said: whether to stop, and whether a Ctrl-C (exit 130) rather than a stop
signal (the requeue exit) was the reason.
"""

import signal

import torch

from megatron_ext.runtime import destroy_distributed, init_distributed
from megatron_ext.train_stop import StopFlag

CASES = {  # name: (rank 0's signals, rank 1's)
    "none": ((), ()),
    "sigterm_both": ((signal.SIGTERM,), (signal.SIGTERM,)),  # scancel signals every task
    "usr1_rank1": ((), (signal.SIGUSR1,)),
    "ctrl_c_both": ((signal.SIGINT,), (signal.SIGINT,)),  # a terminal's Ctrl-C reaches every worker
    "ctrl_c_rank0_sigterm_rank1": ((signal.SIGINT,), (signal.SIGTERM,)),
}

init_distributed("cpu")
rank = torch.distributed.get_rank()
for name, signals in CASES.items():
    stop = StopFlag()
    stop.in_loop = True
    for sig in signals[rank]:
        stop._handle(sig, None)
    stopping = stop.agreed()
    # one write per line: under `python -u` print writes the text and its newline apart, and two ranks
    # appending to one stdout could put the other rank's line between them
    print(f"rank {rank} {name} stop {stopping} interrupted {stop.interrupted_anywhere}\n", end="", flush=True)
    stop.settle()
destroy_distributed()
