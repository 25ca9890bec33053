"""FP8 deployment export with NVIDIA ModelOpt: FP8 weights/activations and FP8 KV cache, calibrated
on long samples, exported as a Hugging Face checkpoint that vLLM and TensorRT-LLM load.

    windows, held = load_windows(prefix, samples=8, seq_length=65536, held_out=2, vocab_size=...)
    model, tok = load_model(hf_dir), load_tokenizer(hf_dir)
    quantize(model, windows, weights="fp8", kv_cache="fp8")
    print(format_table(run_check(model, held, tok)))   # fake-quant vs original
    export(model, out_dir, tok)

`tools/quantize.py` is the command line. ModelOpt is imported only when used (extra `[quantize]`).
"""

# Lazy (PEP 562), as megatron_ext.data: `tools/quantize.py --help` and its argument errors should not pay for
# importing torch, which every submodule but errors needs.
_LAZY = {"load_windows": "calib", "QuantizeError": "errors", "format_report": "report",
         "format_serving_table": "report", "serving_memory": "report", "weight_bytes": "report",
         **dict.fromkeys(["CheckResult", "check_lengths", "compare", "format_table", "run_check"], "check"),
         **dict.fromkeys(["SUPPORTED_ARCHITECTURES", "checkpoint_bytes", "export", "load_model", "load_tokenizer",
                          "modelopt", "quant_config", "quantize", "quantized_layers", "quantizers_disabled",
                          "read_hf_config", "tensor_quantizers"], "fp8")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"megatron_ext.quantize.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megatron_ext.quantize' has no attribute {name!r}")


__all__ = sorted(_LAZY)
