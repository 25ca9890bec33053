"""Command line of `tools/niah.py`: NIAH grids and perplexity by position on an HF or Megatron checkpoint.

    python tools/niah.py --model HF_DIR --lengths 1K:128K:8 --depths 0:100:10 --out runs/niah
    python tools/niah.py --megatron CKPT_DIR --lengths 4K,16K --out runs/niah     # via tools/convert.py
    torchrun --nproc-per-node 8 tools/niah.py --megatron CKPT_DIR --engine megatron --cp 8 --lengths 1M --out runs/niah
    python tools/niah.py ppl --model HF_DIR --text book.txt --out runs/ppl
    python tools/niah.py ppl --model HF_DIR --indexed data/cpt_text_document --documents 8 --out runs/ppl
    torchrun --nproc-per-node 8 tools/niah.py generate --megatron CKPT_DIR --engine megatron --cp 8 \
        --document book.txt --question "How does it end?" --chat
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from megatron_ext.evaluate.errors import EvalError, RankError

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_LENGTH_HELP = "use e.g. 4096, 32K, 1M (K=1024), a list 1K,2K,4K, or a log-spaced range START:END:COUNT like 1K:1M:11"


def _token_count(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGkmg]?)\s*", text)
    if not m:
        raise EvalError(f"--lengths: {text!r} is not a token count; {_LENGTH_HELP}")
    n = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if n < 1 or n != int(n):
        raise EvalError(f"--lengths: {text!r} is not a positive whole number of tokens; {_LENGTH_HELP}")
    return int(n)


def parse_lengths(spec: str) -> list[int]:
    """'1K,4K,1M' -> [1024, 4096, 1048576]; '1K:1M:11' -> 11 log-spaced lengths from 1K to 1M (sorted, unique)."""
    out: list[int] = []
    for part in spec.split(","):
        if ":" in part:
            bits = part.split(":")
            if len(bits) != 3 or not bits[2].strip().isdigit() or int(bits[2]) < 2:
                raise EvalError(f"--lengths: range {part!r} must be START:END:COUNT with COUNT >= 2; {_LENGTH_HELP}")
            lo, hi = _token_count(bits[0]), _token_count(bits[1])
            if hi <= lo:
                raise EvalError(f"--lengths: range {part!r} ends at or below its start; {_LENGTH_HELP}")
            out += [int(round(x)) for x in np.geomspace(lo, hi, int(bits[2]))]
        else:
            out.append(_token_count(part))
    return sorted(set(out))


def parse_depths(spec: str) -> list[float]:
    """'0:100:10' -> 0, 10, ..., 100 (START:END:STEP, END included); '0,50,100' -> [0, 50, 100]. Percent, 0..100."""
    try:
        values = [float(x) for x in spec.split(":" if ":" in spec else ",")]
    except ValueError:
        raise EvalError(f"--depths: {spec!r} is not a list of percentages (e.g. 0,50,100 or 0:100:10)") from None
    depths = values
    if ":" in spec:
        if len(values) != 3 or values[2] <= 0 or values[1] < values[0]:
            raise EvalError(f"--depths: {spec!r} must be START:END:STEP with START <= END and STEP > 0 (e.g. 0:100:10)")
        lo, hi, step = values
        depths = [round(x, 6) for x in np.arange(lo, hi + step / 2, step)]
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise EvalError(f"--depths: {bad} are outside 0..100 (depth is the needle's position in percent of the haystack)")
    return sorted(set(depths))


def _chunk(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count or 'auto'")
    return int(text)


def _common(p: argparse.ArgumentParser, out_required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    src.add_argument("--megatron", type=Path, help="Megatron checkpoint; converted with tools/convert.py to-hf first")
    p.add_argument("--out", type=Path, required=out_required,
                   help="output directory (created; files written atomically)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--chunk", type=_chunk, default="auto", help="prefill chunk in tokens, 0 for one pass, or auto "
                   "(one pass up to 32K tokens, then chunks whose attention mask stays under 1 GiB); hf engine only")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    engine = p.add_argument_group("Megatron engine (--megatron CKPT --engine megatron, under torchrun or srun)")
    engine.add_argument("--engine", choices=("hf", "megatron"), default="hf",
                        help="hf: convert to Hugging Face and run transformers on one device (default); megatron: "
                        "run the checkpoint on all ranks of the job with TP x PP x CP, for contexts one GPU cannot "
                        "hold")
    engine.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    engine.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    engine.add_argument("--cp", type=int, default=1,
                        help="context parallel size (each sequence split over this many ranks)")
    engine.add_argument("--tokenizer", default=None, help="tokenizer directory or name (default: the checkpoint's)")


def _no_kv_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-kv-cache", action="store_true", help="megatron engine: run each decoding step over the "
                   "whole sequence instead of over the new token with the prompt's keys and values kept")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    niah = argparse.ArgumentParser(prog="niah.py", description="Needle-in-a-haystack grid (lengths x depths) -> "
                                   "results.json and heatmap.png. `niah.py ppl --help`: perplexity by position; "
                                   "`niah.py generate --help`: ask the model about a document.")
    _common(niah)
    niah.add_argument("--lengths", default="1K,2K,4K,8K", help=f"context lengths in tokens; {_LENGTH_HELP}")
    niah.add_argument("--depths", default="0:100:10", help="needle depths in percent: 0:100:10 or 0,50,100")
    niah.add_argument("--haystack", type=Path, default=None, help="UTF-8 text file for the filler (default: built-in)")
    niah.add_argument("--samples", type=int, default=1, help="needles (random values) per cell")
    niah.add_argument("--seed", type=int, default=0, help="seed of the values and the built-in filler")
    niah.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    niah.add_argument("--max-new-tokens", type=int, default=16)
    niah.add_argument("--batch-tokens", type=int, default=65536,
                      help="prompt tokens per batch (batch = this // length); hf engine only")
    _no_kv_cache(niah)
    niah.add_argument("--force", action="store_true", help="also run lengths above max_position_embeddings")
    niah.add_argument("--resume", action="store_true", help="keep the cells OUT/results.json already scored (a sweep "
                      "that was stopped, or more lengths/depths/samples): only the others run")
    niah.add_argument("--title", default=None, help="heatmap title")
    ppl = argparse.ArgumentParser(prog="niah.py ppl", description="Loss by token position (log-spaced buckets) over "
                                  "long documents -> ppl.json and ppl.png.")
    _common(ppl)
    docs = ppl.add_mutually_exclusive_group(required=True)
    docs.add_argument("--text", type=Path, nargs="+", help="text files, one document each")
    docs.add_argument("--indexed", default=None, help="Megatron indexed dataset prefix (PREFIX.bin/.idx)")
    ppl.add_argument("--documents", type=int, default=None, help="with --indexed: the N longest documents")
    ppl.add_argument("--seq-len", type=int, default=None, help="cut documents to this many tokens "
                     "(default: max_position_embeddings)")
    ppl.add_argument("--per-octave", type=int, default=2, help="buckets per doubling of the position")
    ppl.add_argument("--label", default=None, help="curve label (default: the model directory name)")
    gen = argparse.ArgumentParser(prog="niah.py generate", description="Greedy answer of the model to a document "
                                  "and a question, printed (and written to OUT/generation.json with --out).")
    _common(gen, out_required=False)
    gen.add_argument("--document", type=Path, default=None, help="UTF-8 text file: the long context")
    gen.add_argument("--question", default=None, help="text after the document (a blank line between)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    _no_kv_cache(gen)
    gen.add_argument("--force", action="store_true", help="also run a prompt longer than max_position_embeddings")
    return {"niah": niah, "ppl": ppl, "generate": gen}


@contextmanager
def _model(args):
    """(model, tokenizer) from --model or --megatron (converted into a temporary directory under --out)."""
    from megatron_ext.evaluate.loading import convert_megatron, load_hf

    if args.model is not None:
        yield load_hf(args.model, args.device, args.dtype)
        return
    if args.out is not None:  # beside the results: the same file system, removed with the directory
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out, prefix=".hf-from-megatron.") as tmp:
        print(f"[niah] converting {args.megatron} to Hugging Face format (tools/convert.py to-hf)", file=sys.stderr)
        yield load_hf(convert_megatron(args.megatron, Path(tmp) / "hf"), args.device, args.dtype)


def _print_memory_note(model, length: int, batch: int, tag: str = "niah") -> None:
    import psutil
    import torch

    from megatron_ext.evaluate.loading import memory_note

    p = next(model.parameters())
    free = torch.cuda.mem_get_info(p.device)[0] if p.device.type == "cuda" else psutil.virtual_memory().available
    n_params = sum(x.numel() for x in model.parameters())
    print(f"[{tag}] " + memory_note(model.config, length, batch, p.element_size(), n_params, free))


def _run_niah(args) -> None:
    from megatron_ext.evaluate.io import model_version, write_json_atomic
    from megatron_ext.evaluate.niah import run_niah
    from megatron_ext.evaluate.plots import plot_niah_heatmap

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    if args.haystack is not None and not args.haystack.is_file():
        raise EvalError(f"--haystack {args.haystack} does not exist: give a UTF-8 text file, or omit --haystack "
                        "to use the built-in filler")

    version = model_version(args.model or args.megatron)

    def save(result) -> tuple[Path, Path]:  # after every length: a long sweep keeps what it has done
        result.settings.update(model=str(args.model or args.megatron), model_version=version)
        return (write_json_atomic(args.out / "results.json", result.to_dict()),
                plot_niah_heatmap(result, args.out / "heatmap.png", title=args.title))

    previous = _previous_grid(args, version) if args.resume else None
    if _megatron_engine(args):
        _run_niah_megatron(args, lengths, depths, save, previous)
        return
    with _model(args) as (model, tokenizer):
        max_pos = getattr(model.config, "max_position_embeddings", None)
        ran = [n for n in lengths if args.force or max_pos is None or n <= max_pos]
        if ran:
            n_cells = len(depths) * args.samples
            _print_memory_note(model, max(ran), min(n_cells, max(1, args.batch_tokens // max(ran))))
        result = run_niah(model, tokenizer, lengths, depths, haystack=args.haystack, samples=args.samples,
                          seed=args.seed, chat=args.chat, max_new_tokens=args.max_new_tokens,
                          batch_tokens=args.batch_tokens, prefill_chunk=args.chunk,
                          allow_beyond_max_positions=args.force, on_progress=save, previous=previous,
                          progress=not args.no_progress)
    js, png = save(result)
    print(f"[niah] accuracy {result.accuracy:.1%}; wrote {js} and {png}")


def _megatron_engine(args) -> bool:
    """True for --engine megatron (which needs --megatron); the layout flags need it."""
    if args.engine == "megatron":
        if args.megatron is None:
            raise EvalError("--engine megatron runs a Megatron checkpoint: give --megatron CKPT_DIR (not --model); "
                            "convert an HF model first with python tools/convert.py to-megatron --hf HF_DIR "
                            "--out CKPT_DIR")
        return True
    if (args.tp, args.pp, args.cp, args.tokenizer, getattr(args, "no_kv_cache", False)) != (1, 1, 1, None, False):
        raise EvalError("--tp, --pp, --cp, --tokenizer and --no-kv-cache belong to --engine megatron; add it "
                        "(with --megatron CKPT)")
    return False


def _previous_grid(args, version: str | None):
    """The grid an earlier run with this --out wrote (--resume), after checking it is the same model's."""
    from megatron_ext.evaluate.niah import NiahResult

    path = args.out / "results.json"
    if not path.is_file():
        return None  # nothing to resume: a first run
    try:
        previous = NiahResult.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise EvalError(f"--resume: {path} is not a NIAH results file ({e}); use another --out") from None
    model = str(args.model or args.megatron)
    if previous.settings.get("model") != model:
        raise EvalError(f"--resume: {path} holds results of {previous.settings.get('model')}, not {model}: use "
                        "another --out")
    if previous.settings.get("model_version") != version:
        raise EvalError(f"--resume: {path} holds results of {model} as it was then "
                        f"({previous.settings.get('model_version')}), not as it is now ({version}): use another --out")
    return previous


def _run_niah_megatron(args, lengths: list[int], depths: list[float], save, previous) -> None:
    from megatron_ext.evaluate.parallel import run_niah_megatron
    from megatron_ext.runtime import process_env

    result = run_niah_megatron(args.megatron, lengths, depths, tensor=args.tp, pipeline=args.pp, context=args.cp,
                               device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                               max_new_tokens=args.max_new_tokens, kv_cache=not args.no_kv_cache, on_progress=save,
                               previous=previous,
                               progress=not args.no_progress, haystack=args.haystack, samples=args.samples,
                               seed=args.seed, chat=args.chat, allow_beyond_max_positions=args.force)
    if process_env().rank == 0:
        js, png = save(result)
        counts = result.settings
        print(f"[niah] accuracy {result.accuracy:.1%} ({counts['forward_passes']} forward passes, "
              f"{counts['decode_steps']} decode steps); wrote {js} and {png}")


def _run_ppl(args) -> None:
    from megatron_ext.evaluate.perplexity import indexed_documents, perplexity_by_position

    if args.text:
        missing = [str(t) for t in args.text if not t.is_file()]
        if missing:
            raise EvalError(f"--text: {', '.join(missing)} does not exist: give UTF-8 text files (one document each)")
    docs = indexed_documents(args.indexed, args.documents) if args.indexed else None
    if _megatron_engine(args):
        from megatron_ext.evaluate.parallel import run_ppl_megatron
        from megatron_ext.runtime import process_env

        result = run_ppl_megatron(args.megatron, texts=None if docs is not None else list(args.text), documents=docs,
                                  tensor=args.tp, pipeline=args.pp, context=args.cp, device=args.device,
                                  dtype=args.dtype, tokenizer=args.tokenizer, progress=not args.no_progress,
                                  seq_len=args.seq_len, per_octave=args.per_octave)
        if process_env().rank == 0:
            _save_ppl(args, result)
        return
    with _model(args) as (model, tokenizer):
        seq = args.seq_len or getattr(model.config, "max_position_embeddings", None)
        _print_memory_note(model, seq or 0, 1, tag="ppl")
        source, texts = (docs, None) if docs is not None else (tokenizer, list(args.text))
        result = perplexity_by_position(model, source, texts=texts, seq_len=args.seq_len,
                                        per_octave=args.per_octave, chunk=args.chunk, progress=not args.no_progress)
    _save_ppl(args, result)


def _save_ppl(args, result) -> None:
    from megatron_ext.evaluate.io import write_json_atomic
    from megatron_ext.evaluate.plots import plot_perplexity

    label = args.label or (args.model or args.megatron).name
    result.settings["model"] = str(args.model or args.megatron)
    result.settings["label"] = label
    js = write_json_atomic(args.out / "ppl.json", result.to_dict())
    max_pos = result.settings.get("max_position_embeddings")
    mark = {f"max_position_embeddings={max_pos:,}": max_pos} if max_pos and max(result.doc_tokens) > max_pos else None
    png = plot_perplexity({label: result}, args.out / "ppl.png", mark=mark)
    print(f"[ppl] {result.documents} documents, {sum(result.doc_tokens):,} tokens, mean loss {result.mean_loss:.4f}; "
          f"wrote {js} and {png}")


def _run_generate(args) -> None:
    from megatron_ext.evaluate.ask import generate_hf, generate_megatron

    if args.document is None and args.question is None:
        raise EvalError("nothing to ask: give --document FILE and/or --question TEXT")
    if args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.document is not None and not args.document.is_file():
        raise EvalError(f"--document {args.document}: no such file; give a UTF-8 text file")
    try:
        document = args.document.read_text(encoding="utf-8") if args.document is not None else ""
    except UnicodeDecodeError as e:
        raise EvalError(f"--document {args.document}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    common = {"chat": args.chat, "max_new_tokens": args.max_new_tokens, "force": args.force}
    if _megatron_engine(args):
        from megatron_ext.runtime import process_env

        result = generate_megatron(args.megatron, document, args.question, tensor=args.tp, pipeline=args.pp,
                                   context=args.cp, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                                   kv_cache=not args.no_kv_cache, **common)
        if process_env().rank != 0:
            return
    else:
        with _model(args) as (model, tokenizer):
            result = generate_hf(model, tokenizer, document, args.question, prefill_chunk=args.chunk, **common)
    result.settings.update(model=str(args.model or args.megatron), document=str(args.document),
                           question=args.question)
    print(f"[generate] {result.prompt_tokens:,} prompt tokens -> {len(result.output_ids)} new tokens in "
          f"{result.seconds:.1f} s", file=sys.stderr)
    print(result.output)
    if args.out is not None:
        from megatron_ext.evaluate.io import write_json_atomic

        print(f"[generate] wrote {write_json_atomic(args.out / 'generation.json', result.to_dict())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of tools/niah.py; user errors end as one `error: ...` line and exit status 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parsers = _parsers()
    command = argv.pop(0) if argv and argv[0] in parsers else "niah"
    args = parsers[command].parse_args(argv)
    run = {"niah": _run_niah, "ppl": _run_ppl, "generate": _run_generate}[command]
    with warnings.catch_warnings():  # our warnings (lengths skipped, ...) as plain "warning: ..." lines
        warnings.simplefilter("ignore")  # libraries' notes (missing Apex/TE, deprecations) are not the user's business
        warnings.filterwarnings("always", category=UserWarning, module=r"megatron_ext(\.|$)")
        warnings.showwarning = lambda msg, *a, **k: print(f"warning: {msg}", file=sys.stderr)
        try:
            run(args)
        except EvalError as e:
            from megatron_ext.runtime import process_env

            # An error every rank of a job finds alike: one line, from rank 0.
            sys.exit(f"error: {e}" if process_env().rank == 0 or isinstance(e, RankError) else 1)
    return 0
