"""The Megatron evaluation engine: start this job's process groups (torchrun or srun), load a checkpoint at a TP x PP
x CP layout (weights only) and hand the evaluations (`parallel.py`, `ruler.py`, `ask.py`) the model, its HF config
and tokenizer, with the greedy decoder and the bookkeeping they share.

    with megatron_engine("checkpoints/cpt_1m", context=8) as engine:
        new_ids = engine.greedy(16)(prompts)
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.log_lines import log_line

if TYPE_CHECKING:
    from megatron_ext.evaluate.parallel import MegatronGreedy


def load_megatron_for_eval(checkpoint, *, tensor: int = 1, pipeline: int = 1, context: int = 1, device: str = "cpu",
                           precision: str = "fp32", attention: str = "auto", cp_comm_type: str = "p2p"):
    """(model for this rank in eval mode, HF config, tokenizer location or None) from a Megatron checkpoint.

    The process group and Megatron's parallel state must already be set up with this layout.
    """
    from megatron_ext.checkpoint import CheckpointError, load_checkpoint
    from megatron_ext.checkpoint_layout import read_metadata
    from megatron_ext.model import BuildOptions, build_model

    try:
        meta = read_metadata(checkpoint)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    hf_cfg = meta.get("hf_config")
    if not hf_cfg:
        raise EvalError(f"{checkpoint}: its metadata has no hf_config; it was not written by megatron_ext")
    opts = BuildOptions(tensor=tensor, pipeline=pipeline, context=context, device=device, precision=precision,
                        attention=attention, cp_comm_type=cp_comm_type,
                        seq_length=int(hf_cfg.get("max_position_embeddings") or 4096), loss_head="chunked")
    model = build_model(hf_cfg, opts)
    try:
        load_checkpoint(checkpoint, [model], weights_only=True)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    generation_eos = (meta.get("generation_config") or {}).get("eos_token_id")
    if generation_eos is not None:  # an Instruct model may name <|eot_id|> there alone: the HF engine reads both
        both = (hf_cfg.get("eos_token_id"), generation_eos)
        flat = {int(i) for v in both if v is not None for i in (v if isinstance(v, list) else [v])}
        hf_cfg = {**hf_cfg, "eos_token_id": sorted(flat)}
    return model.eval(), hf_cfg, meta.get("tokenizer")


@dataclass
class Engine:
    """The model of this rank and what the evaluations need around it."""

    model: object
    hf_config: dict
    tokenizer: object
    device: torch.device
    precision: str
    layout: dict  # tensor, pipeline, context, data
    rank0: bool

    def greedy(self, max_new_tokens: int, kv_cache: bool = True, until_number: bool = True) -> "MegatronGreedy":
        """The greedy `generate` of this engine: stops at the tokenizer's or the model's EOS, or (`until_number`, NIAH)
        once the first number of the answer is settled. `kv_cache`: decode steps after the prompt's pass (else
        full passes)."""
        from megatron_ext.evaluate.generate import eos_ids
        from megatron_ext.evaluate.parallel import MegatronGreedy
        from megatron_ext.evaluate.speculative import number_settled

        tok = self.tokenizer
        eos = eos_ids(SimpleNamespace(config=SimpleNamespace(eos_token_id=self.hf_config.get("eos_token_id"))), tok)
        settled = (lambda ids: number_settled(tok.decode(ids, skip_special_tokens=True))) if until_number else None
        return MegatronGreedy(self.model, self.hf_config["vocab_size"], max_new_tokens, eos, device=self.device,
                              settled=settled, kv_cache=kv_cache)

    def announce(self, tag: str, lengths, greedy: "MegatronGreedy", force: bool) -> int:
        """Print (rank 0) the layout, the tokens per rank and the KV cache per rank at the longest length that will
        run (the shortest when none is within max_position_embeddings: that error comes later); return it."""
        from megatron_ext.evaluate.loading import human_bytes, kv_cache_bytes_per_token

        max_pos = self.hf_config.get("max_position_embeddings")
        longest = max(n for n in lengths if force or not max_pos or n <= max_pos or n == min(lengths))
        if self.rank0:
            per_token = kv_cache_bytes_per_token(self.hf_config, 2 if self.precision == "bf16" else 4)
            l = self.layout
            per_rank = longest * per_token / (l["tensor"] * l["pipeline"] * l["context"])  # split over a replica
            cache = f", KV cache {human_bytes(per_rank)} per rank" if greedy.cache is not None else ", no KV cache"
            log_line(f"[{tag}] {self.describe()}; {longest // l['context']:,} tokens per rank at {longest:,}{cache}")
        return longest

    def run_arguments(self, longest: int, on_progress, progress: bool) -> dict:
        """What `run_niah` and `run_ruler` take from the engine: rank 0 alone saves, shows progress and logs, and a
        batch holds a row per data-parallel replica at the longest length; the engine and dtype the outputs are
        computed with (what --resume compares)."""
        return dict(max_position_embeddings=self.hf_config.get("max_position_embeddings"),
                    numerics={"engine": "megatron", "dtype": self.precision},
                    batch_tokens=self.layout["data"] * longest, on_progress=on_progress if self.rank0 else None,
                    progress=progress and self.rank0, log=log_line if self.rank0 else None, prefill_chunk=None)

    def record(self, settings: dict, greedy: "MegatronGreedy") -> None:
        """Put the engine, its layout and precision, and the full passes, extension passes (with the prompt tokens
        they shared) and decode steps of all replicas into a result's `settings` (a collective: every rank calls
        it). The cache is freed: the run is over."""
        from megatron.core import parallel_state as ps

        counts = torch.tensor([greedy.passes, greedy.extensions, greedy.shared_tokens, greedy.decode_steps],
                              device=self.device)
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
        settings.update(engine="megatron", layout=self.layout, dtype=self.precision, kv_cache=greedy.cache is not None,
                        forward_passes=int(counts[0]), extension_passes=int(counts[1]), shared_tokens=int(counts[2]),
                        decode_steps=int(counts[3]))
        if greedy.cache is not None:
            greedy.cache.clear()

    def describe(self) -> str:
        l = self.layout
        return (f"Megatron engine: TP {l['tensor']} x PP {l['pipeline']} x CP {l['context']}, DP {l['data']} "
                f"({dist.get_world_size()} ranks, {self.precision})")


def _tensor_fits(tensor: int, cfg: dict) -> bool:
    """Whether Megatron-Core splits this model over `tensor` TP ranks: equal slices of the attention heads and the
    MLP, and whole KV heads per rank, or (more ranks than KV heads) each KV head on tensor / kv_heads ranks."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return (heads % tensor == 0 and cfg["intermediate_size"] % tensor == 0
            and (kv_heads % tensor == 0 if kv_heads >= tensor else tensor % kv_heads == 0))


def _check_layout(checkpoint, tensor: int, pipeline: int) -> None:
    """EvalError naming --tp or --pp, the checkpoint's sizes and the values that fit, when the model does not split
    evenly over `tensor` TP ranks or its layers over `pipeline` stages: found from the metadata, before the process
    group and the model (Megatron-Core stopped the build on every rank with a ValueError or a bare AssertionError).
    Metadata that cannot be read is left to the load to report."""
    from megatron_ext.checkpoint_index import CheckpointError
    from megatron_ext.checkpoint_layout import read_metadata

    if tensor <= 1 and pipeline <= 1:
        return
    try:
        cfg = read_metadata(checkpoint)["hf_config"]
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        cfg = {**cfg, "num_attention_heads": heads, "intermediate_size": int(cfg["intermediate_size"]),
               "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads)}
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return
    if layers % pipeline:
        fits = [k for k in range(1, layers + 1) if layers % k == 0]
        raise EvalError(f"--pp {pipeline}: the model in {checkpoint} has {layers} layers, which do not split evenly "
                        f"over {pipeline} pipeline stages; give a --pp that divides {layers} "
                        f"({', '.join(map(str, fits))}), or use --tp/--cp to spread the model instead")
    if not _tensor_fits(tensor, cfg):
        fits = [str(k) for k in range(1, heads + 1) if _tensor_fits(k, cfg)]
        raise EvalError(f"--tp {tensor}: the model in {checkpoint} ({heads} attention heads, "
                        f"{cfg['num_key_value_heads']} KV heads, MLP width {cfg['intermediate_size']}) does not split "
                        f"evenly over {tensor} tensor-parallel ranks; give --tp {', '.join(fits[:-1])} or {fits[-1]}, "
                        "or use --cp to spread long prompts instead")


@contextmanager
def megatron_engine(checkpoint, *, tensor: int = 1, pipeline: int = 1, context: int = 1, device: str | None = None,
                    dtype: str | None = None, tokenizer=None, needs_tokenizer: bool = True) -> Iterator[Engine]:
    """Start the process group for this job's ranks (torchrun or srun; DP = world / (TP x PP x CP)), load the
    checkpoint at that layout, and end the group on exit. `tokenizer`: a directory or name (default: the one
    the checkpoint records)."""
    from megatron_ext.evaluate.loading import megatron_tokenizer, resolve_dtype
    from megatron_ext.runtime import destroy_distributed, init_distributed, process_env

    if not Path(checkpoint).is_dir():
        raise EvalError(f"Megatron checkpoint {checkpoint} does not exist: give a training run's checkpoint.dir or "
                        "the output of tools/convert.py to-megatron")
    _check_layout(checkpoint, tensor, pipeline)  # before the process count: no count of processes makes it fit
    world = process_env().world_size
    if min(tensor, pipeline, context) < 1 or world % (tensor * pipeline * context):
        raise EvalError(f"--tp {tensor} x --pp {pipeline} x --cp {context} must divide the {world} processes "
                        "(start as many as TP x PP x CP x DP with torchrun --nproc-per-node or srun)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(resolve_dtype(dtype, torch.device(device)))
    if precision is None:
        raise EvalError(f"--dtype {dtype}: the Megatron engine runs bf16 or fp32")
    init_distributed(device, tensor=tensor, pipeline=pipeline, context=context)
    from megatron.core import parallel_state as ps  # after: on the CPU, Megatron-Core without TE/Apex (cpu_backend P0)

    try:
        model, hf_cfg, recorded = load_megatron_for_eval(checkpoint, tensor=tensor, pipeline=pipeline, context=context,
                                                         device=device, precision=precision)
        layout = {"tensor": tensor, "pipeline": pipeline, "context": context,
                  "data": ps.get_data_parallel_world_size()}
        where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        tok = megatron_tokenizer(checkpoint, tokenizer, recorded, hf_cfg.get("vocab_size")) if needs_tokenizer else None
        engine = Engine(model, hf_cfg, tok, where, precision, layout, dist.get_rank() == 0)
        with warnings.catch_warnings():
            if not engine.rank0:  # one copy of each warning
                warnings.simplefilter("ignore")
            yield engine
    finally:
        destroy_distributed()
