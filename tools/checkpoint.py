#!/usr/bin/env python
"""What a checkpoint holds, whether it is complete, and what a run would do with it; its optimizer state re-saved
for any layout.

    python tools/checkpoint.py info checkpoints/cpt_4m
    python tools/checkpoint.py info checkpoints/cpt_4m --recipe recipes/cpt_4m.yaml --world-size 128
    torchrun --nproc_per_node=8 tools/checkpoint.py reshard checkpoints/cpt_4m --out checkpoints/cpt_4m_any   # TP x PP processes

See `python tools/checkpoint.py info --help` and `... reshard --help`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ext.runtime.signals import exit_after_main, main_imported  # noqa: E402 (the standard library only)

if __name__ == "__main__":
    import signal

    main = main_imported("megatron_ext.checkpoint_cli")  # it imports numpy: a Ctrl-C there is one line

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `checkpoint.py info ... | head` ends quietly, as a Unix filter does
    exit_after_main(main())  # a Ctrl-C while Python exits (torch's teardown, a second) changes the outcome no more
