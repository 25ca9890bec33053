"""Long-context evaluation: needle-in-a-haystack (NIAH) and perplexity by position, with plots.

Both work on any Hugging Face causal LM (`AutoModelForCausalLM` + `AutoTokenizer`) on any device,
and are plain functions so the demo can call them on its tiny base and final models:

    result = run_niah(model, tokenizer, lengths=[1024, 4096], depths=[0, 50, 100])
    plot_niah_heatmap(result, "niah.png"); write_json_atomic("results.json", result.to_dict())
    ppl = perplexity_by_position(model, tokenizer, texts=["long document ..."])
    plot_perplexity({"final": ppl}, "ppl.png")
"""

from importlib import import_module

from megatron_ext.evaluate.errors import EvalError

# The module each public name lives in, imported at the first use of the name: the tools that run on a login node
# (the launcher, slurm/pipeline.sh) need only EvalError, and the rest imports torch and transformers (seconds).
_HOMES = {
    "greedy_generate": "generate", "Haystack": "haystack", "builtin_haystack": "haystack",
    "file_haystack": "haystack", "save_figure_atomic": "io", "write_json_atomic": "io",
    "kv_cache_bytes_per_token": "loading", "load_hf": "loading", "memory_note": "loading", "NeedleTask": "niah",
    "NiahResult": "niah", "build_prompt": "niah", "extract_value": "niah", "run_niah": "niah",
    "score_output": "niah", "PerplexityResult": "perplexity", "indexed_documents": "perplexity",
    "log_buckets": "perplexity", "perplexity_by_position": "perplexity", "plot_niah_heatmap": "plots",
    "plot_perplexity": "plots",
}
__all__ = ["EvalError", *sorted(_HOMES)]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"megatron_ext.evaluate.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
