"""CPT corpus preparation: documents -> tokens (+ separator) -> Megatron-Core indexed dataset.

Each stored document is `tokens(text) + separator`, so in the stream Megatron-Core's `GPTDataset`
concatenates, exactly one separator lies between consecutive documents and fixed-length
sequences cross document boundaries with no document mask (the paper's setup). Documents and
the separator are tokenized separately and joined as token ids: joining the *text* first would
let BPE merge the separator into its neighbours (Llama-3 pre-tokenizes "end.<s>The" as
".<", "s", ">The"), so the marker would differ from boundary to boundary.

Per-source length upsampling (the paper's Fu et al. 2024 corpus: short documents downsampled,
long ones upsampled) is a list of rules `[SOURCE:]CLASS=RATE` where CLASS is `ltN` (fewer than N
tokens), `gtN` (more than N tokens) or `all`; N takes k (x1024) / m (x1024^2) suffixes; a bare
`SOURCE=RATE` means `SOURCE:all=RATE`. A document gets the rate of its source's matching rule,
else of the matching source-less rule, else 1. A rule for a source no document has is an error (sources
are the input names unless --source-field is given; a warning only when --max-tokens ends the read
first, as the source may come later). Rate r writes floor(r) copies plus one more with
probability frac(r), decided by a hash of (seed, document number): deterministic and independent
of batching or thread count.
"""

from __future__ import annotations

import os
import queue
import re
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_ext.data.common import (FORMAT_VERSION, DataError, atomic_outputs, check_outputs, length_histogram,
                                      load_tokenizer, token_dtype, tokenizer_hash,
                                      tokenizer_vocabulary_hash, write_json)
from megatron_ext.data.sources import ReadStats, check_inputs, input_name, iter_texts
from megatron_ext.progress import progress_bar

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class UpsampleRule:
    """Rate for documents of `source` (None: any) whose token length is in [lo, hi)."""

    source: str | None
    lo: int
    hi: int | None
    rate: float


def _tokens(n: str) -> int:
    m = re.fullmatch(r"(\d+)([kKmM]?)", n)
    if not m:
        raise ValueError(n)
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]


def parse_upsample(spec: str | None) -> list[UpsampleRule]:
    """Parse 'lt4k=0.5,gt8k=2.0,github=0.5,arxiv:gt8k=3'; DataError naming the bad part."""
    rules: list[UpsampleRule] = []
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        key, eq, val = part.partition("=")
        try:
            rate = float(val)
            if not eq or rate < 0:
                raise ValueError(val)
            source, colon, cls = key.rpartition(":")
            if not colon and not re.fullmatch(r"(lt|gt)\d+[kKmM]?|all", cls):
                if re.match(r"(lt|gt)\d", cls):  # a mistyped class ('lt4q'), not a source: it would match nothing
                    raise ValueError(cls)
                source, cls = cls, "all"  # bare SOURCE=RATE
            if cls == "all":
                lo, hi = 0, None
            elif cls.startswith("lt"):
                lo, hi = 0, _tokens(cls[2:])
            elif cls.startswith("gt"):
                lo, hi = _tokens(cls[2:]) + 1, None
            else:
                raise ValueError(cls)
        except ValueError:
            raise DataError(f"--upsample {spec}: bad rule '{part}'; expected [SOURCE:]ltN|gtN|all=RATE "
                            "with N a token count (4096, 4k, 1m) and RATE >= 0, e.g. 'lt4k=0.5,gt8k=2.0'") from None
        new = UpsampleRule(source or None, lo, hi, rate)
        for r in rules:  # overlapping classes at one level would make the rate ambiguous
            if r.source == new.source and lo < (r.hi or 1 << 62) and r.lo < (hi or 1 << 62):
                raise DataError(f"--upsample {spec}: rule '{part}' overlaps another rule for the same source")
        rules.append(new)
    return rules


def _unmatched_sources(rules: list[UpsampleRule], seen) -> list[str]:
    """Sources named by `rules` that are not in `seen`, in rule order: such a rule changes nothing."""
    return list(dict.fromkeys(r.source for r in rules if r.source is not None and r.source not in seen))


def _no_such_source(spec: str, missing: list[str], seen, how: str) -> str:
    return (f"--upsample {spec}: no document has source {', '.join(repr(m) for m in missing)}, so its rule "
            f"changes nothing; the sources ({how}) are: {', '.join(sorted(seen)) or 'none'}")


def upsample_rate(rules: list[UpsampleRule], source: str, n_tokens: int) -> float:
    """The rate of a document (pure): source-specific rule, else generic rule, else 1.0."""
    for want in (source, None):
        for r in rules:
            if r.source == want and r.lo <= n_tokens and (r.hi is None or n_tokens < r.hi):
                return r.rate
    return 1.0


def uniform_hash(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from (seed, index) via splitmix64 (pure, platform independent)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def copies(rate: float, seed: int, index: int) -> int:
    """floor(rate) copies plus one with probability frac(rate)."""
    whole = int(rate)
    return whole + (uniform_hash(seed, index) < rate - whole)


def separator_ids(tok: Any, separator: str) -> tuple[list[int], list[int]]:
    """(prefix ids, suffix ids) around every document for --separator TEXT | bos-eos | none."""
    if separator == "none":
        return [], []
    if separator == "bos-eos":
        vocab = tok.get_vocab()
        bos = tok.bos_token_id
        eos = vocab.get("<|end_of_text|>", tok.eos_token_id)  # Llama-3's document end, not <|eot_id|>
        if bos is None or eos is None:
            raise DataError("--separator bos-eos: the tokenizer has no BOS/EOS token; use '<s>' or none")
        return [bos], [eos]
    ids = tok.backend_tokenizer.encode(separator, add_special_tokens=False).ids
    if not ids:
        raise DataError(f"--separator {separator!r}: encodes to no tokens; for no separator between documents "
                        "pass --separator none, else give text (default '<s>') or bos-eos")
    return [], ids


def _batches(it: Iterator[tuple[str, str]], max_docs: int, max_chars: int) -> Iterator[list[tuple[str, str]]]:
    batch, chars = [], 0
    for item in it:
        batch.append(item)
        chars += len(item[1])
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _prefetch(gen: Iterator, depth: int = 2) -> Iterator:
    """Run `gen` in a thread (reading/JSON parsing overlaps tokenization, which drops the GIL).

    The bounded queue keeps memory at `depth` batches; exceptions are re-raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    end, stop = object(), threading.Event()

    def work() -> None:
        try:
            for b in gen:
                while not stop.is_set():
                    try:
                        q.put(b, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(end)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        while True:
            b = q.get()
            if b is end:
                return
            if isinstance(b, BaseException):
                raise b
            yield b
    finally:
        stop.set()


def prepare_cpt(inputs: list[str], tokenizer: str, output: str, *, text_field: str = "text",
                source_field: str | None = None, separator: str = "<s>", upsample: str | None = None,
                max_tokens: int | None = None, seq_length: int | None = None, seed: int = 1234,
                force: bool = False, batch_docs: int = 1024, batch_chars: int = 8 << 20,
                progress: bool = True) -> dict:
    """Tokenize `inputs` into `output`.bin/.idx (Megatron-Core IndexedDatasetBuilder) + .json manifest.

    Returns the manifest. Raises DataError on user mistakes; nothing is left at `output` then.
    `seq_length`, when given, checks the corpus holds at least one training sequence.
    """
    t0 = time.perf_counter()
    check_inputs(inputs)
    rules = parse_upsample(upsample)
    if not source_field:  # the sources are the input names: a rule for another source is a mistake, said now
        names = {input_name(i) for i in inputs}
        missing = _unmatched_sources(rules, names)
        if missing:
            raise DataError(_no_such_source(upsample, missing, names, "the input names, as no --source-field is "
                                            "given") + "; name one of them, or pass --source-field FIELD")
    if max_tokens is not None and max_tokens <= 0:
        raise DataError(f"--max-tokens {max_tokens}: must be positive")
    if seq_length is not None and seq_length <= 0:
        raise DataError(f"--seq-length {seq_length}: must be positive")
    check_outputs(output, force, inputs=inputs)
    tok = load_tokenizer(tokenizer, announce="cpt" if progress else None)
    tok_hash = tokenizer_hash(tok)  # a fixed cost (serializes the tokenizer): part of setup
    vocab_hash = tokenizer_vocabulary_hash(tok)
    pre, post = separator_ids(tok, separator)
    backend = tok.backend_tokenizer
    # A document's own text is text: a web page quoting "<|eot_id|>" or "<|begin_of_text|>" must not train the
    # model on control tokens mid-document (the separator's ids are fixed above)
    backend.encode_special_tokens = True
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets needed
    vocab_size = len(tok)
    dtype = token_dtype(vocab_size)
    stats = ReadStats()
    per_source: dict[str, dict[str, int]] = defaultdict(lambda: {"documents_read": 0, "documents_written": 0,
                                                                 "tokens_written": 0})
    lengths: list[int] = []
    n_read = n_tokens = 0
    max_id = -1  # recorded so that the trainer can refuse a model whose embedding has no row for some id
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # after the cheap checks

    with atomic_outputs(output) as tmp:
        builder = IndexedDatasetBuilder(tmp[output + ".bin"], dtype=dtype)
        bar = progress_bar(desc="cpt", unit="tok", unit_scale=True, total=max_tokens, enabled=progress)
        t_stream = time.perf_counter()  # setup (tokenizer load) excluded from the streaming rate
        cpu_stream = time.process_time()  # all threads' CPU time: robust on a shared machine
        batches = _prefetch(_batches(iter_texts(inputs, text_field, source_field, stats), batch_docs, batch_chars))
        done = False
        try:
            for batch in batches:
                encs = encode([t for _, t in batch], add_special_tokens=False)
                for (source, _), enc in zip(batch, encs):
                    ids = enc.ids
                    rate = upsample_rate(rules, source, len(ids))
                    k = copies(rate, seed, n_read)
                    n_read += 1
                    s = per_source[source]
                    s["documents_read"] += 1
                    if not ids or k == 0:
                        continue
                    doc = np.array(pre + ids + post, dtype=dtype)
                    max_id = max(max_id, int(doc.max()))
                    for _ in range(k):
                        builder.add_document(doc, [doc.size])
                    lengths.extend([doc.size] * k)
                    s["documents_written"] += k
                    s["tokens_written"] += k * doc.size
                    n_tokens += k * doc.size
                    done = max_tokens is not None and n_tokens >= max_tokens
                    if done:  # documents are not cut: the last one may overshoot --max-tokens; the bar ends at 100%
                        bar.total = n_tokens
                    bar.update(k * doc.size)
                    if done:
                        break
                if done:
                    break
            bar.total = n_tokens  # a corpus shorter than --max-tokens: it ends at 100% of what there was
        finally:
            bar.close()
            batches.close()
        builder.finalize(tmp[output + ".idx"])
        missing = _unmatched_sources(rules, per_source)
        if missing and not done:  # everything was read: the rule names a source that is not there (a typo?)
            raise DataError(_no_such_source(upsample, missing, per_source, f"--source-field {source_field}")
                            + "; fix the rule or --source-field")
        if done:
            print(f"note: --max-tokens {max_tokens} stopped the read after {n_read} documents: the data is the head "
                  "of the inputs' order (sorted by source or length, they give a skewed mix: shuffle them first)",
                  file=sys.stderr)
        if missing:  # --max-tokens stopped the read: the source may come later in the inputs
            print(f"warning: {_no_such_source(upsample, missing, per_source, f'--source-field {source_field}')} "
                  f"in the documents read before --max-tokens {max_tokens} stopped the read", file=sys.stderr)
        if not lengths:
            raise DataError(f"--input {' '.join(inputs)}: empty corpus (no documents written; {n_read} read, "
                            f"{stats.empty} empty; skipped {stats.summary()}; "
                            "upsampling rates of 0 drop documents too)")
        if seq_length is not None and n_tokens < seq_length + 1:
            raise DataError(f"corpus has {n_tokens} tokens but one sequence of --seq-length {seq_length} needs "
                            f"{seq_length + 1} (one extra for the shifted labels): {seq_length + 1 - n_tokens} "
                            "tokens missing; add data or lower the sequence length")
        manifest = {
            "format_version": FORMAT_VERSION, "kind": "cpt", "documents": len(lengths), "documents_read": n_read,
            "tokens": n_tokens, "per_source": {k: per_source[k] for k in sorted(per_source)},
            "length_histogram": length_histogram(np.array(lengths)),
            "skipped": {"non_utf8_lines": stats.non_utf8, "bad_json_lines": stats.bad_json,
                        "not_object_lines": stats.not_object, "empty_documents": stats.empty},
            "dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "max_token_id": max_id, "tokenizer": tokenizer,
            "tokenizer_hash": tok_hash, "vocabulary_hash": vocab_hash, "separator": separator,
            "separator_ids": {"prefix": pre, "suffix": post},
            "settings": {"inputs": list(inputs), "text_field": text_field, "source_field": source_field,
                         "upsample": upsample, "max_tokens": max_tokens, "seed": seed},
        }
        write_json(tmp[output + ".json"], manifest)
    dt = time.perf_counter() - t_stream
    cpu = time.process_time() - cpu_stream
    stats.report()
    if progress:
        print(f"wrote {output}.bin/.idx/.json: {len(lengths)} documents from {stats.inputs_read()}, {n_tokens} tokens "
              f"in {dt:.1f}s "
              f"({n_tokens / max(dt, 1e-9):,.0f} tokens/s, {os.environ.get('RAYON_NUM_THREADS', 'all')} threads; "
              f"setup {t_stream - t0:.1f}s, cpu {cpu:.1f}s)",
              file=sys.stderr)
    return manifest
