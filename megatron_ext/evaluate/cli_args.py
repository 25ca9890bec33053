"""Arguments of `tools/niah.py` and its subcommands (ppl, generate, ruler): parsers and the parsing of lengths
and depths; `cli.py` runs them."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from megatron_ext.evaluate.errors import EvalError

DTYPE_NAMES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")  # loading._DTYPES' keys (tested)
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_LENGTH_HELP = "use e.g. 4096, 32K, 1M (K=1024), a list 1K,2K,4K, or a log-spaced range START:END:COUNT like 1K:1M:11"


def _token_count(text: str, flag: str = "--lengths", hint: str = _LENGTH_HELP) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGkmg]?)\s*", text)
    if not m:
        raise EvalError(f"{flag}: {text!r} is not a token count; {hint}")
    n = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if n < 1 or n != int(n):
        raise EvalError(f"{flag}: {text!r} is not a positive whole number of tokens; {hint}")
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
            import numpy as np  # not at the top: tools/niah.py imports this module before its Ctrl-C handling begins

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
        import numpy as np  # not at the top: tools/niah.py imports this module before its Ctrl-C handling begins

        depths = [round(float(x), 6) for x in np.arange(lo, hi + step / 2, step)]  # plain floats in messages
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
    src.add_argument("--megatron", type=Path, help="Megatron checkpoint; the hf engine converts it with "
                     "tools/convert.py to-hf first (into a hidden folder of --out), the megatron engine runs it as is")
    p.add_argument("--out", type=Path, required=out_required,
                   help="output directory (created; files written atomically)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub name (default: the model's own; "
                   "for --megatron the one the checkpoint records), e.g. for a checkpoint saved without one")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES, metavar="DTYPE",
                   help="bf16, fp16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
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


def _no_kv_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-kv-cache", action="store_true", help="megatron engine: run each decoding step over the "
                   "whole sequence instead of over the new token with the prompt's keys and values kept")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of each command: niah (the default), ppl, generate, ruler."""
    from megatron_ext.evaluate.ruler_tasks import TASKS  # the prompts' module: not for the launcher's length checks

    niah = argparse.ArgumentParser(prog="niah.py", description="Needle-in-a-haystack grid (lengths x depths) -> "
                                   "results.json and heatmap.png. `niah.py ppl --help`: perplexity by position; "
                                   "`niah.py generate --help`: ask the model about a document; `niah.py ruler "
                                   "--help`: RULER-style tasks.")
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
    niah.add_argument("--force", action="store_true", help="also run lengths above max_position_embeddings, and "
                      "replace the results of an earlier run in --out (without --resume)")
    niah.add_argument("--resume", action="store_true", help="keep the cells OUT/results.json already scored (a sweep "
                      "that was stopped, or more lengths/depths/samples): only the others run; without it (or "
                      "--force) an --out with results is refused")
    niah.add_argument("--title", default=None, help="heatmap title")
    ppl = argparse.ArgumentParser(prog="niah.py ppl", description="Loss by token position (log-spaced buckets) over "
                                  "long documents -> ppl.json and ppl.png.")
    _common(ppl)
    docs = ppl.add_mutually_exclusive_group(required=True)
    docs.add_argument("--text", type=Path, nargs="+", help="text files, one document each")
    docs.add_argument("--indexed", default=None, help="Megatron indexed dataset prefix (PREFIX.bin/.idx)")
    ppl.add_argument("--documents", type=int, default=None,
                     help="with --indexed: the N longest documents (default 8; the whole corpus would take days)")
    ppl.add_argument("--seq-len", default=None, help="cut documents to this many tokens, at least 2: 65536, 64K, 1M "
                     "(default: max_position_embeddings)")
    ppl.add_argument("--per-octave", type=int, default=2, help="buckets per doubling of the position")
    ppl.add_argument("--label", default=None, help="curve label (default: the model directory name)")
    ppl.add_argument("--force", action="store_true", help="replace another model's ppl.json in --out (the same "
                     "model's is replaced without it)")
    gen = argparse.ArgumentParser(prog="niah.py generate", description="Greedy answer of the model to a document "
                                  "and a question, printed (and written to OUT/generation.json with --out).")
    _common(gen, out_required=False)
    gen.add_argument("--document", type=Path, default=None, help="UTF-8 text file: the long context")
    gen.add_argument("--question", default=None, help="text after the document (a blank line between)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    _no_kv_cache(gen)
    gen.add_argument("--force", action="store_true", help="also run a prompt longer than max_position_embeddings")
    ruler = argparse.ArgumentParser(prog="niah.py ruler", description="RULER-style synthetic tasks (retrieval with "
                                    "several needles, variable tracking, word aggregation) x lengths -> ruler.json and "
                                    "ruler.md. Our wording of RULER's tasks: compare models and lengths with it, not "
                                    "with published RULER tables.")
    _common(ruler)
    ruler.add_argument("--tasks", default="all", help="all, niah (the 8 retrieval tasks), or a comma list of: "
                       + ", ".join(TASKS))
    ruler.add_argument("--lengths", default="4K,8K,16K,32K", help=f"context lengths in tokens; {_LENGTH_HELP}")
    ruler.add_argument("--samples", type=int, default=4, help="prompts per task and length")
    ruler.add_argument("--seed", type=int, default=0, help="seed of the prompts and the built-in filler")
    ruler.add_argument("--haystack", type=Path, default=None, help="UTF-8 text file for the retrieval tasks' filler "
                       "(default: built-in)")
    ruler.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ruler.add_argument("--max-new-tokens", type=int, default=None, help="answer budget of every task (default: "
                       "per task: 128 retrieval, 50 vt, 120 cwe, 50 fwe)")
    ruler.add_argument("--batch-tokens", type=int, default=65536, help="prompt tokens per batch; hf engine only")
    _no_kv_cache(ruler)
    ruler.add_argument("--force", action="store_true", help="also run lengths above max_position_embeddings, and "
                       "replace the results of an earlier run in --out (without --resume)")
    ruler.add_argument("--resume", action="store_true", help="keep the cells OUT/ruler.json already scored; only the "
                       "others run; without it (or --force) an --out with results is refused")
    return {"niah": niah, "ppl": ppl, "generate": gen, "ruler": ruler}


def _at_least(flag: str, value: int | None, low: int, what: str) -> None:
    if value is not None and value < low:
        raise EvalError(f"{flag} {value}: must be >= {low} ({what})")


def _check_out(out: Path | None) -> None:
    """The directory --out names must be creatable: no file, nor a link to nothing, where it or a folder above it
    should be (the FileExistsError of mkdir otherwise comes after the model has loaded, as a traceback)."""
    if out is None:
        return
    for p in (out.absolute(), *out.absolute().parents):
        if p.is_symlink() and not p.exists():  # mkdir's FileExistsError came at the first save, after a length
            where = "is" if p == out.absolute() else f"lies under {p}, which is"
            raise EvalError(f"--out {out} {where} a link to {os.readlink(p)}, which does not exist: create that "
                            "folder, or give another --out")
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == out.absolute() else f"lies under {p}, which is a file"
                raise EvalError(f"--out {out} {where}: give a directory path (it is created)")
            return


def _holds_a_model(folder: Path) -> bool:
    """An HF model folder (config.json), a Megatron checkpoint folder or one iteration folder of it."""
    from megatron_ext.checkpoint_layout import LATEST_FILE

    return folder.is_dir() and ((folder / "config.json").is_file() or (folder / LATEST_FILE).is_file()
                                or re.fullmatch(r"iter_\d+", folder.resolve().name) is not None
                                or any(folder.glob("iter_*")))


def _check_out_apart(command: str, out: Path | None, args: argparse.Namespace) -> None:
    """--out must not be the model folder (--model, --megatron) or lie inside it: results.json and the plots were
    written among the weights, into a checkpoint that tools/convert.py and the trainer read as a whole."""
    if out is None:
        return
    where = out.resolve()
    for flag in ("--model", "--megatron"):
        model = getattr(args, flag[2:], None)
        if model is None or not _holds_a_model(Path(model)):  # a hub name; a folder of no model: the loader says so
            continue
        folder = Path(model).resolve()
        if where == folder or folder in where.parents:
            how = "is" if where == folder else "lies inside"
            raise EvalError(f"--out {out} {how} {flag} {model} (the model being evaluated): write the results to a "
                            f"separate folder, e.g. --out runs/{command}")


def validate_args(command: str, args: argparse.Namespace) -> None:
    """User mistakes argparse lets through, found before a model is loaded, as EvalError; turns --seq-len
    (e.g. 64K) into an int."""
    for flag in ("--tp", "--pp", "--cp"):
        _at_least(flag, getattr(args, flag[2:], None), 1, "a parallel size of the Megatron engine")
    if command in ("niah", "ruler"):
        _at_least("--samples", args.samples, 1, "prompts per cell")
        _at_least("--batch-tokens", args.batch_tokens, 1, "prompt tokens per batch")
    if command != "ppl":
        _at_least("--max-new-tokens", args.max_new_tokens, 1, "the answer's token budget: 0 would score nothing")
    if command == "ppl":
        _at_least("--per-octave", args.per_octave, 1, "buckets per doubling of the position")
        if args.documents is not None and args.text:
            raise EvalError(f"--documents {args.documents} picks the longest documents of --indexed; with --text "
                            "every file is one document: drop --documents (or give fewer files)")
        _at_least("--documents", args.documents, 1, "the N longest documents of --indexed")
        if args.seq_len is not None:
            args.seq_len = _token_count(args.seq_len, "--seq-len", "use e.g. 65536, 64K, 1M (K=1024), at least 2")
            _at_least("--seq-len", args.seq_len, 2, "a loss needs a token and the one before it")
    if command == "generate" and args.question is not None and not args.question.strip():
        # an empty question asked the model to go on after the document, as if --question were not given
        raise EvalError(f"--question {args.question!r} is blank: give the question's text, or omit --question to "
                        "have the model continue the --document")
    if command == "generate" and args.megatron is not None and args.engine == "hf" and args.out is None:
        # the conversion is a full copy of the weights (16 GB at 8B): not into the system's temporary folder
        raise EvalError(f"generate --megatron {args.megatron}: the transformers engine converts the checkpoint "
                        "into a hidden folder of --out first; give --out DIR on a file system with room for the "
                        "model's weights, or use --engine megatron (no conversion)")
    _check_out(args.out)
    _check_out_apart(command, args.out, args)
