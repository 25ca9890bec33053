#!/usr/bin/env python
"""Needle-in-a-haystack heatmaps, RULER-style tasks and perplexity by position for HF or Megatron checkpoints.

    python tools/niah.py --model HF_DIR --lengths 1K:128K:8 --depths 0:100:10 --out runs/niah
    python tools/niah.py ruler --model HF_DIR --tasks all --lengths 4K:128K:6 --out runs/ruler
    python tools/niah.py ppl --model HF_DIR --text book.txt --out runs/ppl
    torchrun --nproc-per-node 8 tools/niah.py --megatron CKPT --engine megatron --cp 8 --lengths 1M --out runs/niah

See `python tools/niah.py --help` and `python tools/niah.py {ppl,generate,ruler} --help`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ext.evaluate.cli import main  # noqa: E402

if __name__ == "__main__":
    from megatron_ext.runtime.signals import exit_after_main

    exit_after_main(main())  # a Ctrl-C while Python exits (a second) changes the outcome no more
