"""FP8 deployment export with NVIDIA ModelOpt: FP8 weights/activations and FP8 KV cache, calibrated
on long samples, exported as a Hugging Face checkpoint that vLLM and TensorRT-LLM load.

    windows, held = load_windows(prefix, samples=8, seq_length=65536, held_out=2, vocab_size=...)
    model, tok = load_model(hf_dir), load_tokenizer(hf_dir)
    quantize(model, windows, weights="fp8", kv_cache="fp8")
    print(format_table(run_check(model, held, tok)))   # fake-quant vs original
    export(model, out_dir, tok)

`tools/quantize.py` is the command line. ModelOpt is imported only when used (extra `[quantize]`).
"""

from megatron_ext.quantize.calib import load_windows
from megatron_ext.quantize.check import CheckResult, check_lengths, compare, format_table, run_check
from megatron_ext.quantize.errors import QuantizeError
from megatron_ext.quantize.fp8 import (
    SUPPORTED_ARCHITECTURES, checkpoint_bytes, export, load_model, load_tokenizer, modelopt, quant_config, quantize,
    quantized_layers, quantizers_disabled, read_hf_config, tensor_quantizers,
)
from megatron_ext.quantize.report import format_report, format_serving_table, serving_memory, weight_bytes

__all__ = [
    "CheckResult", "QuantizeError", "SUPPORTED_ARCHITECTURES", "check_lengths", "checkpoint_bytes", "compare",
    "export", "format_report", "format_serving_table", "format_table", "load_model", "load_tokenizer", "load_windows", "modelopt",
    "quant_config", "quantize", "quantized_layers", "quantizers_disabled", "read_hf_config", "run_check",
    "serving_memory", "tensor_quantizers", "weight_bytes",
]
