"""FP8 deployment export of a Hugging Face Llama checkpoint with NVIDIA ModelOpt.

    python tools/quantize.py --hf HF_DIR --out OUT_DIR --calib DATA_PREFIX \
        [--weights fp8|none] [--kv-cache fp8|none] [--calib-samples N] [--calib-seq-length L] [--check]

Calibrates on long windows of our own data (indexed dataset PREFIX, text files or an HF dataset),
quantizes weights, activations and the KV cache to FP8, optionally checks perplexity / logits /
NIAH of the fake-quant model against the original, exports an HF checkpoint (vLLM, TensorRT-LLM)
and prints what was quantized, the sizes and the KV-cache bytes per token. Needs the `[quantize]`
extra. Exit status: 0 written, 1 the check failed (nothing written), 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ext.quantize.cli import main  # noqa: E402

if __name__ == "__main__":
    from megatron_ext.runtime.signals import exit_after_main

    exit_after_main(main())  # a Ctrl-C while Python exits (a second) changes the outcome no more
