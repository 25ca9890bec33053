"""Ask a long-context model about a document: greedy generation on either engine (`tools/niah.py generate`).

    python tools/niah.py generate --model HF_DIR --document report.txt --question "Who signed it?" --chat
    torchrun --nproc-per-node 8 tools/niah.py generate --megatron CKPT --engine megatron --cp 8 \
        --document book.txt --question "How does the story end?" --chat --max-new-tokens 256

The transformers engine prefills the prompt in chunks through its KV cache on one device; the Megatron engine
splits the prompt over TP x PP x CP ranks and decodes with its KV cache spread over the CP ranks (`parallel.py`,
`kv_cache.py`), for documents one GPU cannot hold. Both continue greedily until an end-of-sequence token or
`max_new_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.log_lines import log_line


@dataclass
class Generation:
    """One prompt's greedy continuation and how it was made."""

    prompt_tokens: int
    output: str
    output_ids: list[int]
    seconds: float
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def document_prompt(tokenizer, document: str, question: str | None = None, chat: bool = False) -> list[int]:
    """Token ids of `document` followed by `question` (a blank line between): the tokenizer's chat template around
    them as one user message with the assistant header after (`chat`), else plain text after BOS."""
    content = "\n\n".join(part for part in (document.rstrip(), question) if part)
    if not content.strip():
        raise EvalError("the prompt is empty: give --document FILE with text in it, or --question TEXT")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise EvalError("--chat needs a tokenizer with a chat template; this one has none (drop --chat)")
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has its own BOS
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer(content, add_special_tokens=False)["input_ids"]


def _check_length(n: int, max_positions: int | None, force: bool) -> None:
    if max_positions and n > max_positions and not force:
        raise EvalError(f"the prompt has {n:,} tokens, more than the model's max_position_embeddings = "
                        f"{max_positions:,}: shorten --document, or add --force to run it anyway")


def generate_hf(model, tokenizer, document: str, question: str | None = None, *, chat: bool = False,
                max_new_tokens: int = 256, prefill_chunk: int | str | None = "auto", force: bool = False) -> Generation:
    """Greedy answer of an HF model (`load_hf`) to the document prompt."""
    from megatron_ext.evaluate.generate import eos_ids, greedy_generate

    ids = document_prompt(tokenizer, document, question, chat)
    _check_length(len(ids), getattr(model.config, "max_position_embeddings", None), force)
    start = time.perf_counter()
    out = greedy_generate(model, torch.tensor([ids]), max_new_tokens, eos_token_ids=eos_ids(model, tokenizer),
                          prefill_chunk=prefill_chunk)[0]
    return Generation(len(ids), tokenizer.decode(out, skip_special_tokens=True), out, time.perf_counter() - start,
                      {"engine": "hf", "chat": chat, "max_new_tokens": max_new_tokens})


def generate_megatron(checkpoint, document: str, question: str | None = None, *, chat: bool = False,
                      max_new_tokens: int = 256, tensor: int = 1, pipeline: int = 1, context: int = 1,
                      device: str | None = None, dtype: str | None = None, tokenizer=None, kv_cache: bool = True,
                      force: bool = False) -> Generation:
    """Greedy answer of a Megatron checkpoint over this job's ranks (`megatron_engine`); every rank calls it and
    gets the result."""
    from megatron_ext.evaluate.engine import megatron_engine

    with megatron_engine(checkpoint, tensor=tensor, pipeline=pipeline, context=context, device=device, dtype=dtype,
                         tokenizer=tokenizer) as engine:
        ids = document_prompt(engine.tokenizer, document, question, chat)
        _check_length(len(ids), engine.hf_config.get("max_position_embeddings"), force)
        if engine.rank0:
            log_line(f"[generate] {engine.describe()}; {len(ids):,} prompt tokens, {len(ids) // context:,} per rank")
        generate = engine.greedy(max_new_tokens, kv_cache=kv_cache, until_number=False)
        start = time.perf_counter()
        out = generate(torch.tensor([ids]))[0]
        return Generation(len(ids), engine.tokenizer.decode(out, skip_special_tokens=True), out,
                          time.perf_counter() - start,
                          {"engine": "megatron", "layout": engine.layout, "dtype": engine.precision, "chat": chat,
                           "max_new_tokens": max_new_tokens, "kv_cache": generate.cache is not None,
                           "forward_passes": generate.passes, "decode_steps": generate.decode_steps})
