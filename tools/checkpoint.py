#!/usr/bin/env python
"""What a checkpoint holds, whether it is complete, and what a run would do with it.

    python tools/checkpoint.py info runs/cpt_4m
    python tools/checkpoint.py info runs/cpt_4m --recipe recipes/cpt_4m.yaml --world-size 128

See `python tools/checkpoint.py info --help`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ext.checkpoint_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
