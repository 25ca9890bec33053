"""Perplexity by position: per-token loss averaged in log-spaced position buckets over long documents.

Token t of a document (t >= 1) is predicted from the t tokens before it; its position is t. A
model that uses its extended context keeps lowering the loss as t grows; one that does not
flattens (or rises) past its trained window. Buckets double in width (`per_octave` per doubling)
so 1M-token documents still give a readable curve.
"""

from __future__ import annotations

import hashlib

import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.io import read_utf8
from megatron_ext.evaluate.generate import auto_prefill_chunk, chunked_forward
from megatron_ext.progress import progress_bar


def log_buckets(n_tokens: int, per_octave: int = 1) -> list[tuple[int, int]]:
    """Half-open position buckets [start, end) covering positions 1 .. n_tokens-1 exactly once.

    Edges are round(2 ** (k / per_octave)), deduplicated, with the last edge n_tokens. For
    n_tokens=10, per_octave=1: [(1, 2), (2, 4), (4, 8), (8, 10)].
    """
    if n_tokens < 2:
        raise EvalError(f"a document needs at least 2 tokens for a loss, got {n_tokens}")
    if per_octave < 1:
        raise EvalError(f"per_octave must be >= 1, got {per_octave}")
    edges = {1}
    k = 0
    while True:
        e = int(round(2 ** (k / per_octave)))
        if e >= n_tokens:
            break
        edges.add(e)
        k += 1
    edges = sorted(edges) + [n_tokens]
    return list(zip(edges[:-1], edges[1:]))


@torch.inference_mode()
def token_losses(model, ids: torch.Tensor, chunk: int | str | None = "auto") -> torch.Tensor:
    """Per-token negative log-likelihood [T-1] (fp32) of a document `ids` [T]: entry t-1 is token t's loss.

    The document runs through the model in chunks with a KV cache, so memory for logits is one
    chunk's [c, V], not the document's. `chunk`: "auto" (at most 4096, see `auto_prefill_chunk`),
    tokens, or None for one pass.
    """
    device = next(model.parameters()).device
    ids = ids.to(device)
    if chunk == "auto":
        chunk = min(4096, auto_prefill_chunk(len(ids)))
    losses = torch.empty(len(ids) - 1, dtype=torch.float32, device=device)
    for start, logits, _ in chunked_forward(model, ids[None], chunk, logits_for_all=True):
        c = logits.shape[1]
        targets = ids[start + 1:start + c + 1]  # the chunk's last position predicts the next chunk's first token
        n = len(targets)
        losses[start:start + n] = F.cross_entropy(logits[0, :n].float(), targets, reduction="none")
    return losses


@dataclass
class PerplexityResult:
    """Loss by position: buckets [{start, end, tokens, mean_loss, perplexity}] over `documents` documents."""

    buckets: list[dict]
    documents: int
    doc_tokens: list[int]
    settings: dict = field(default_factory=dict)

    @property
    def mean_loss(self) -> float:
        """Token-weighted mean loss over all positions."""
        tok = sum(b["tokens"] for b in self.buckets)
        return sum(b["mean_loss"] * b["tokens"] for b in self.buckets if b["tokens"]) / max(tok, 1)

    def to_dict(self) -> dict:
        return {"mean_loss": self.mean_loss, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "PerplexityResult":
        return cls(d["buckets"], d["documents"], d["doc_tokens"], d.get("settings", {}))


def indexed_documents(prefix: str | Path, max_documents: int | None = None, vocab_size: int | None = None,
                      tokenizer=None, tokenizer_name: str | None = None) -> list[np.ndarray]:
    """Token-id documents of a Megatron indexed dataset `PREFIX.bin/.idx`, the longest first.

    A document is the concatenation of its sequences (Megatron's document index); each text counts once (the copies
    `--upsample` writes are skipped). With `max_documents`, only the longest ones: those say most about long
    positions. With `vocab_size` (the model's),
    EvalError for a token id the model has no embedding for (data of another tokenizer). EvalError too for an SFT
    dataset or its loss mask, and, with the model's `tokenizer` (from `tokenizer_name`), for data its manifest says
    another tokenizer made (`token_data.token_data_problem`).
    """
    prefix = str(prefix).removesuffix(".bin").removesuffix(".idx")
    if not (Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()):
        raise EvalError(f"indexed dataset {prefix}.bin/.idx not found: give the prefix written by "
                        "tools/prepare_data.py (the path without .bin/.idx)")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data import DataError
    from megatron_ext.data.dataset_files import check_complete
    from megatron_ext.evaluate.token_data import token_data_problem

    try:
        check_complete(prefix)  # Megatron-Core's reader fails on a cut or foreign file with a bare traceback
    except DataError as e:
        raise EvalError(f"--indexed: {e}") from None
    problem = token_data_problem(prefix, "--indexed", tokenizer, tokenizer_name)
    if problem:
        raise EvalError(problem)
    ds = IndexedDataset(prefix)
    bounds = ds.document_indices  # [D+1] sequence index where each document starts
    lengths = np.add.reduceat(ds.sequence_lengths, bounds[:-1]) if len(bounds) > 1 else np.zeros(0, np.int64)
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, then in file order
    # Distinct documents only: prepare_data.py cpt --upsample writes a document's copies one after another, and the
    # longest are the ones upsampled (`gt8k=2.0`: the 8 longest would be 4 texts twice).
    docs, seen = [], set()
    for i in order:
        if max_documents is not None and len(docs) == max_documents:
            break
        doc = np.concatenate([ds[j] for j in range(bounds[i], bounds[i + 1])]).astype(np.int64)
        key = hashlib.sha256(doc.tobytes()).digest()
        if key not in seen:
            seen.add(key)
            docs.append(doc)
    largest = max((int(d.max()) for d in docs if len(d)), default=-1)
    if vocab_size is not None and largest >= vocab_size:
        raise EvalError(f"--indexed {prefix}: token ids up to {largest}, but the model's vocab_size is {vocab_size} "
                        f"(ids 0..{vocab_size - 1}): the data was tokenized with another tokenizer; prepare it with "
                        "the model's (tools/prepare_data.py)")
    return docs


def tokenized_documents(source, texts: Sequence[str | Path] | None, seq_len: int | None) -> list[torch.Tensor]:
    """The documents `perplexity_by_position` evaluates, as token-id tensors cut to `seq_len`: `texts` tokenized by
    `source` (a tokenizer), or `source` itself (token-id documents). Those under 2 tokens are left out; EvalError
    when none is left. tools/niah.py sizes its memory note on them before the run."""
    if hasattr(source, "encode") or hasattr(source, "convert_tokens_to_ids"):  # a tokenizer
        if not texts:
            raise EvalError("perplexity by position with a tokenizer needs texts= (strings, or Paths of text files)")
        docs = []
        for t in texts:
            if isinstance(t, Path):  # a file; a str is the text itself
                if not t.is_file():
                    raise EvalError(f"document file {t} does not exist")
                t = read_utf8(t, "document file")
            # BOS as in training; the tokenizer adds it when its post-processor does.
            docs.append(torch.tensor(source(t)["input_ids"], dtype=torch.long))
    else:
        if isinstance(source, torch.Tensor) and source.dim() == 2:
            source = list(source)
        docs = [torch.as_tensor(np.asarray(d), dtype=torch.long).flatten() for d in source]
    if seq_len is not None:
        if seq_len < 2:  # d[:-5] would evaluate all but the last 5 tokens, d[:0] nothing
            raise EvalError(f"seq_len must be >= 2 tokens (a loss needs a token and the one before it), got {seq_len}")
        docs = [d[:seq_len] for d in docs]
    docs = [d for d in docs if len(d) >= 2]
    if not docs:
        raise EvalError("perplexity by position got no document with at least 2 tokens")
    return docs


def perplexity_by_position(model, tokenizer_or_token_tensors, *, texts: Sequence[str | Path] | None = None,
                           seq_len: int | None = None, per_octave: int = 2, chunk: int | str | None = "auto",
                           progress: bool = True, token_losses_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           max_position_embeddings: int | None = None,
                           documents_losses_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
                           ) -> PerplexityResult:
    """Per-token loss of `model` averaged in log-spaced position buckets over long documents.

    Second argument: a tokenizer (then `texts`: strings, or `Path`s of text files, one document each) or
    token-id documents (1D tensors/arrays/lists, or a [N, T] tensor). Documents are cut to
    `seq_len` tokens (default: the model's max_position_embeddings). Buckets span the longest
    document; shorter ones add to the buckets they reach. `token_losses_fn` (document ids [T] -> losses
    [T-1]) replaces `token_losses(model, ...)`; `model` may then be None, with `max_position_embeddings`.
    `documents_losses_fn` (all documents -> their losses, in order) replaces both: replicas of the Megatron engine
    share the documents that way.
    """
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", max_position_embeddings)
    if seq_len is None:
        seq_len = max_pos
    docs = tokenized_documents(tokenizer_or_token_tensors, texts, seq_len)
    longest = max(len(d) for d in docs)
    if max_pos is not None and longest > max_pos:
        warnings.warn(f"documents run to {longest:,} tokens, beyond the model's max_position_embeddings={max_pos:,}: "
                      "the curve past it shows extrapolation", stacklevel=2)
    buckets = log_buckets(longest, per_octave)
    edges = np.array([s for s, _ in buckets] + [buckets[-1][1]])
    sums = np.zeros(len(buckets))
    counts = np.zeros(len(buckets), dtype=np.int64)
    if documents_losses_fn is not None:
        pairs = zip(docs, documents_losses_fn(docs))
    else:
        docs_iter = docs
        if progress:
            docs_iter = progress_bar(docs, desc="ppl", unit="doc")
        # Pairs drawn from the bar itself, not zip(docs, losses): zip stopped on `docs` before the bar's iterator
        # resumed to count (and close on) its last document, which left it at N-1/N.
        pairs = ((d, token_losses_fn(d) if token_losses_fn is not None else token_losses(model, d, chunk))
                 for d in docs_iter)
    for d, loss in pairs:
        loss = loss.double().cpu().numpy()  # [T-1], entry t-1 = position t
        pos = np.arange(1, len(d))
        which = np.searchsorted(edges, pos, side="right") - 1
        sums += np.bincount(which, weights=loss, minlength=len(buckets))
        counts += np.bincount(which, minlength=len(buckets))
    rows = []
    for (s, e), total, n in zip(buckets, sums, counts):
        mean = float(total / n) if n else None
        rows.append({"start": s, "end": e, "tokens": int(n), "mean_loss": mean,
                     "perplexity": math.exp(mean) if mean is not None and mean < 700 else None})
    settings = {"seq_len": seq_len, "per_octave": per_octave, "chunk": chunk, "max_position_embeddings": max_pos,
                "model": getattr(getattr(model, "config", None), "_name_or_path", None)
                or (type(model).__name__ if model is not None else None)}
    if model is not None:  # the HF engine's numerics (the Megatron engine records its own: run_ppl_megatron)
        from megatron_ext.evaluate.run_settings import engine_settings

        settings.update(engine_settings(model, None))
    return PerplexityResult(rows, len(docs), [len(d) for d in docs], settings)
