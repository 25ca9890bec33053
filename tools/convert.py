#!/usr/bin/env python
"""Hugging Face Llama-3.1 <-> Megatron-Core checkpoints.

    python tools/convert.py to-megatron --hf HF_DIR --out MEGATRON_DIR [--dtype bf16|fp32] [--verify]
    python tools/convert.py to-hf --megatron MEGATRON_DIR --out HF_DIR [--iteration N]
        [--rope-preset ultralong-1m|ultralong-2m|ultralong-4m [--rope-preset-differs-ok] | --max-position-embeddings N]
        [--verify]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ext.convert_cli import main  # noqa: E402  (first: it hides the GPUs before torch is imported)

if __name__ == "__main__":
    from megatron_ext.runtime.signals import exit_after_main

    exit_after_main(main())  # a Ctrl-C while Python exits (a second) changes the outcome no more
