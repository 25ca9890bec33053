"""Long-context evaluation: needle-in-a-haystack (NIAH) and perplexity by position, with plots.

Both work on any Hugging Face causal LM (`AutoModelForCausalLM` + `AutoTokenizer`) on any device,
and are plain functions so the demo can call them on its tiny base and final models:

    result = run_niah(model, tokenizer, lengths=[1024, 4096], depths=[0, 50, 100])
    plot_niah_heatmap(result, "niah.png"); write_json_atomic("results.json", result.to_dict())
    ppl = perplexity_by_position(model, tokenizer, texts=["long document ..."])
    plot_perplexity({"final": ppl}, "ppl.png")
"""

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.generate import greedy_generate
from megatron_ext.evaluate.haystack import Haystack, builtin_haystack, file_haystack
from megatron_ext.evaluate.io import save_figure_atomic, write_json_atomic
from megatron_ext.evaluate.loading import kv_cache_bytes_per_token, load_hf, memory_note
from megatron_ext.evaluate.niah import NeedleTask, NiahResult, build_prompt, extract_value, run_niah, score_output
from megatron_ext.evaluate.perplexity import PerplexityResult, indexed_documents, log_buckets, perplexity_by_position
from megatron_ext.evaluate.plots import plot_niah_heatmap, plot_perplexity

__all__ = [
    "EvalError", "Haystack", "NeedleTask", "NiahResult", "PerplexityResult", "build_prompt", "builtin_haystack",
    "extract_value", "file_haystack", "greedy_generate", "indexed_documents", "kv_cache_bytes_per_token", "load_hf", "log_buckets",
    "memory_note", "perplexity_by_position", "plot_niah_heatmap", "plot_perplexity", "run_niah",
    "save_figure_atomic", "score_output", "write_json_atomic",
]
