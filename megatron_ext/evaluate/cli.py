"""Command line of `tools/niah.py`: NIAH grids, perplexity by position, generation and RULER-style tasks on an HF
or Megatron checkpoint (the arguments: `cli_args.py`).

    python tools/niah.py --model HF_DIR --lengths 1K:128K:8 --depths 0:100:10 --out runs/niah
    python tools/niah.py --megatron CKPT_DIR --lengths 4K,16K --out runs/niah     # via tools/convert.py
    torchrun --nproc-per-node 8 tools/niah.py --megatron CKPT_DIR --engine megatron --cp 8 --lengths 1M --out runs/niah
    python tools/niah.py ppl --model HF_DIR --text book.txt --out runs/ppl
    python tools/niah.py ppl --model HF_DIR --indexed data/cpt --documents 8 --out runs/ppl
    torchrun --nproc-per-node 8 tools/niah.py generate --megatron CKPT_DIR --engine megatron --cp 8 \
        --document book.txt --question "How does it end?" --chat
    python tools/niah.py ruler --model HF_DIR --tasks all --lengths 4K:128K:6 --samples 10 --out runs/ruler
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

from megatron_ext.evaluate.cli_args import parse_depths, parse_lengths, parsers, validate_args
from megatron_ext.evaluate.cli_model import data_tokenizer, early_tokenizer, model_and_tokenizer, model_vocab_size
from megatron_ext.evaluate.errors import EvalError, RankError
from megatron_ext.evaluate.interrupts import interrupts_reported
from megatron_ext.evaluate.io import OutputWriteError, check_writable_folder, not_there, read_utf8
from megatron_ext.log_lines import log_line
from megatron_ext.runtime.held_signals import interrupts_held
from megatron_ext.runtime.signals import interrupted_as_it_started, sigterm_as_interrupt


def _print_memory_note(model, length: int, batch: int, tag: str = "niah") -> None:
    import psutil
    import torch

    from megatron_ext.evaluate.loading import memory_note

    p = next(model.parameters())
    free = torch.cuda.mem_get_info(p.device)[0] if p.device.type == "cuda" else psutil.virtual_memory().available
    n_params = sum(x.numel() for x in model.parameters())
    log_line(f"[{tag}] " + memory_note(model.config, length, batch, p.element_size(), n_params, free))


def _check_haystack(args) -> None:
    """--haystack exists and is UTF-8 text: found before the model is loaded."""
    if args.haystack is None:
        return
    if not args.haystack.is_file():
        raise EvalError(f"--haystack {args.haystack} {not_there(args.haystack)}: give a UTF-8 text file, or omit --haystack "
                        "to use the built-in filler")
    read_utf8(args.haystack, "--haystack")


def _run_niah(args) -> None:
    from megatron_ext.evaluate.io import model_version, write_json_atomic
    from megatron_ext.evaluate.niah import run_niah
    from megatron_ext.evaluate.plots import plot_niah_heatmap

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    _check_haystack(args)

    version = model_version(args.model or args.megatron)

    def save(result) -> tuple[Path, Path]:  # after every length: a long sweep keeps what it has done
        result.settings.update(model=str(args.model or args.megatron), model_version=version)
        return (write_json_atomic(args.out / "results.json", result.to_dict()),
                plot_niah_heatmap(result, args.out / "heatmap.png", title=args.title))

    _refuse_earlier_results(args, "results.json")
    previous = _previous_grid(args, version) if args.resume else None
    if _megatron_engine(args):
        _run_niah_megatron(args, lengths, depths, save, previous)
        return
    with model_and_tokenizer(args) as (model, tokenizer):
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
    log_line(f"[niah] accuracy {result.accuracy:.1%}; wrote {js} and {png}")


def _megatron_engine(args) -> bool:
    """True for --engine megatron (which needs --megatron); the layout flags need it."""
    if args.engine == "megatron":
        if args.megatron is None:
            raise EvalError("--engine megatron runs a Megatron checkpoint: give --megatron CKPT_DIR (not --model); "
                            "convert an HF model first with python tools/convert.py to-megatron --hf HF_DIR "
                            "--out CKPT_DIR")
        return True
    if (args.tp, args.pp, args.cp, getattr(args, "no_kv_cache", False)) != (1, 1, 1, False):
        raise EvalError("--tp, --pp, --cp and --no-kv-cache belong to --engine megatron; add it "
                        "(with --megatron CKPT)")
    return False


def _refuse_earlier_results(args, name: str) -> None:
    """An --out that holds results (`name`) of an earlier run, of any model, is refused unless --resume extends them
    or --force replaces them: they were overwritten without a word, another model's too. ppl (no --resume) refuses
    another model's ppl.json only: running the same model again makes the same curve anew."""
    path = args.out / name
    if getattr(args, "resume", False) or args.force or not path.is_file():
        return
    model = str(args.model or args.megatron)
    try:
        earlier = json.loads(path.read_text())
        of = earlier["settings"]["model"]
    except (OSError, ValueError, TypeError, KeyError):
        earlier, of = None, None
    if name == "ppl.json" and of == model:
        return
    if earlier is None:
        what = f"a {name} this command cannot read"
    else:
        lengths, cells = earlier.get("lengths"), earlier.get("cells")
        detail = [f"lengths {', '.join(map(str, lengths))}" if isinstance(lengths, list) and lengths else "",
                  _count(cells, "cell") if isinstance(cells, list) else "",
                  _count(earlier["documents"], "document") if isinstance(earlier.get("documents"), int) else ""]
        what = f"results of {of} ({'; '.join([name, *filter(None, detail)])})"
    resume = "--resume to extend them, " if name != "ppl.json" else ""
    raise EvalError(f"--out {args.out} holds {what}; pass {resume}--force to replace them, or another --out")


def _count(items, noun: str) -> str:
    n = items if isinstance(items, int) else len(items)
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _previous_grid(args, version: str | None, name: str = "results.json", kind=None):
    """The results an earlier run with this --out wrote (--resume), after checking they are the same model's."""
    from megatron_ext.evaluate.niah import NiahResult

    path = args.out / name
    if not path.is_file():
        return None  # nothing to resume: a first run
    try:
        previous = (kind or NiahResult).from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise EvalError(f"--resume: {path} is not a {name} of this command ({e}); use another --out") from None
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
        shared = (f", {counts['extension_passes']} passes after a shared prefix ({counts['shared_tokens']:,} prompt "
                  "tokens not run again)" if counts.get("extension_passes") else "")
        log_line(f"[niah] accuracy {result.accuracy:.1%} ({counts['forward_passes']} forward passes{shared}, "
                 f"{counts['decode_steps']} decode steps); wrote {js} and {png}")


def _run_ruler(args) -> None:
    from megatron_ext.evaluate.io import model_version, write_json_atomic, write_text_atomic
    from megatron_ext.evaluate.ruler import RulerResult, check_lengths, run_ruler, run_ruler_megatron
    from megatron_ext.evaluate.ruler_tasks import task_names

    tasks, lengths = task_names(args.tasks), parse_lengths(args.lengths)
    _check_haystack(args)
    version = model_version(args.model or args.megatron)

    def save(result) -> tuple[Path, Path]:
        result.settings.update(model=str(args.model or args.megatron), model_version=version)
        title = (f"# RULER-style tasks: {args.model or args.megatron}\n\n{args.samples} prompts per task and "
                 f"length, scores in percent ({'chat' if args.chat else 'plain'} prompts).\n\n")
        return (write_json_atomic(args.out / "ruler.json", result.to_dict()),
                write_text_atomic(args.out / "ruler.md", title + result.table() + "\n"))

    _refuse_earlier_results(args, "ruler.json")
    previous = _previous_grid(args, version, "ruler.json", RulerResult) if args.resume else None
    common = dict(samples=args.samples, seed=args.seed, chat=args.chat, haystack=args.haystack,
                  max_new_tokens=args.max_new_tokens, allow_beyond_max_positions=args.force, previous=previous,
                  on_progress=save, progress=not args.no_progress)
    megatron = _megatron_engine(args)
    # Every task at every length before the model loads (minutes at 8B): a length too short failed one task at a
    # time, each after a load. The prompts, and so the lengths they need, are the tokenizer's.
    tokenizer = early_tokenizer(args)
    if tokenizer is not None:
        check_lengths(tokenizer, tasks, lengths, samples=args.samples, seed=args.seed, chat=args.chat,
                      haystack=args.haystack, what="--lengths")
    if megatron:
        from megatron_ext.runtime import process_env

        result = run_ruler_megatron(args.megatron, tasks, lengths, tensor=args.tp, pipeline=args.pp, context=args.cp,
                                    device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                                    kv_cache=not args.no_kv_cache, **common)
        if process_env().rank != 0:
            return
    else:
        with model_and_tokenizer(args, tokenizer if args.model is not None else None) as (model, tokenizer):
            max_pos = getattr(model.config, "max_position_embeddings", None)
            ran = [n for n in lengths if args.force or max_pos is None or n <= max_pos]
            if ran:
                _print_memory_note(model, max(ran), min(args.samples, max(1, args.batch_tokens // max(ran))), "ruler")
            result = run_ruler(model, tokenizer, tasks, lengths, batch_tokens=args.batch_tokens,
                               prefill_chunk=args.chunk, **common)
    js, md = save(result)
    print(result.table())  # a Markdown table, as ruler.md holds it: no time on its rows
    log_line(f"[ruler] average {100 * result.accuracy:.1f} over {len(tasks)} tasks x {len(result.lengths)} lengths; "
             f"wrote {js} and {md}")


def _run_ppl(args) -> None:
    from megatron_ext.evaluate.perplexity import indexed_documents, perplexity_by_position, tokenized_documents

    _refuse_earlier_results(args, "ppl.json")
    if args.text:
        missing = [f"{t} {not_there(t)}" for t in args.text if not t.is_file()]
        if missing:
            raise EvalError(f"--text: {', '.join(missing)}: give UTF-8 text files (one document each)")
        for t in args.text:  # before the model is loaded
            if not read_utf8(t, "--text").strip():
                raise EvalError(f"--text {t}: no text in the file; give text files of one document each")
    tokenizer = docs = None
    if args.indexed:  # data of another tokenizer or kind, before the model loads (it ran and exited 0)
        tokenizer, name = data_tokenizer(args)
        docs = indexed_documents(args.indexed, args.documents or 8, vocab_size=model_vocab_size(args),
                                 tokenizer=tokenizer, tokenizer_name=name)
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
    with model_and_tokenizer(args, tokenizer) as (model, tokenizer):
        seq = args.seq_len or getattr(model.config, "max_position_embeddings", None)
        # The note is sized on the longest document as it will run (cut to `seq`), not on --seq-len: `--seq-len 1M`
        # on a 3,236-token book promised 512 MiB of KV cache. The texts are tokenized once, here.
        ids = tokenized_documents(*((docs, None) if docs is not None else (tokenizer, list(args.text))), seq)
        _print_memory_note(model, max(len(d) for d in ids), 1, tag="ppl")
        result = perplexity_by_position(model, ids, seq_len=args.seq_len, per_octave=args.per_octave,
                                        chunk=args.chunk, progress=not args.no_progress)
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
    log_line(f"[ppl] {result.documents} documents, {sum(result.doc_tokens):,} tokens, mean loss "
             f"{result.mean_loss:.4f}; wrote {js} and {png}")


def _run_generate(args) -> None:
    from megatron_ext.evaluate.ask import generate_hf, generate_megatron

    if args.document is None and args.question is None:
        raise EvalError("nothing to ask: give --document FILE and/or --question TEXT")
    if args.document is not None and not args.document.is_file():
        raise EvalError(f"--document {args.document} {not_there(args.document)}: give a UTF-8 text file")
    document = read_utf8(args.document, "--document") if args.document is not None else ""
    common = {"chat": args.chat, "max_new_tokens": args.max_new_tokens, "force": args.force}
    if _megatron_engine(args):
        from megatron_ext.runtime import process_env

        result = generate_megatron(args.megatron, document, args.question, tensor=args.tp, pipeline=args.pp,
                                   context=args.cp, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                                   kv_cache=not args.no_kv_cache, **common)
        if process_env().rank != 0:
            return
    else:
        with model_and_tokenizer(args) as (model, tokenizer):
            result = generate_hf(model, tokenizer, document, args.question, prefill_chunk=args.chunk, **common)
    result.settings.update(model=str(args.model or args.megatron), document=str(args.document),
                           question=args.question)
    log_line(f"[generate] {result.prompt_tokens:,} prompt tokens -> {len(result.output_ids)} new tokens in "
             f"{result.seconds:.1f} s", sys.stderr)
    print(result.output)  # the model's answer, the command's output: as it was generated
    if args.out is not None:
        from megatron_ext.evaluate.io import write_json_atomic

        log_line(f"[generate] wrote {write_json_atomic(args.out / 'generation.json', result.to_dict())}", sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of tools/niah.py; user errors end as one `error: ...` line and exit status 1 (Ctrl-C: 130)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # From the first moment: the parsers import numpy (ruler's prompts), a tenth of a second in which a Ctrl-C was a
    # bare traceback and a SIGTERM ended the process without a word. The signal waits for the import, then is one line.
    with sigterm_as_interrupt():
        try:
            with interrupts_held():
                by_command = parsers()
            command = argv.pop(0) if argv and argv[0] in by_command else "niah"
            args = by_command[command].parse_args(argv)
        except KeyboardInterrupt as e:
            return interrupted_as_it_started(e, "nothing was written")
        return _main(command, args)


PLOTTED = ("niah", "ppl")  # the commands that draw: matplotlib is imported with the others, the signals held


def _main(command: str, args) -> int:
    run = {"niah": _run_niah, "ppl": _run_ppl, "generate": _run_generate, "ruler": _run_ruler}[command]
    # SIGTERM (scancel, a time limit) removes the temporary HF copy of a --megatron checkpoint, as Ctrl-C does; both
    # end in one line saying what was kept. Our warnings (lengths skipped, ...) as plain "warning: ..." lines:
    with warnings.catch_warnings(), interrupts_reported(command, args):
        warnings.simplefilter("ignore")  # libraries' notes (missing Apex/TE, deprecations) are not the user's business
        warnings.filterwarnings("always", category=UserWarning, module=r"megatron_ext(\.|$)")
        warnings.showwarning = lambda msg, *a, **k: print(f"warning: {msg}", file=sys.stderr)
        from megatron_ext.runtime import DeviceError, process_env

        try:
            validate_args(command, args)
            check_writable_folder(args.out, "--out")  # here, not at the first save after the model load and a length
            # torch after the argument checks, a signal held until it is imported: one inside its C++ set-up was a
            # bare traceback, or pybind11's abort (runtime/held_signals.py); matplotlib's the same (its first import
            # was at the first heatmap). Not Megatron-Core (Python on top of torch): on the CPU path Transformer
            # Engine must be kept out before it is imported (cpu_backend, P0)
            with interrupts_held():
                from megatron_ext.evaluate.loading import check_device
                if command in PLOTTED:
                    from megatron_ext.evaluate.plots import load_matplotlib

                    load_matplotlib()
            check_device(args.device, megatron_engine=args.engine == "megatron")
            run(args)
        except (EvalError, DeviceError) as e:  # every rank of a job finds it alike: one line, from rank 0
            sys.exit(f"error: {e}" if process_env().rank == 0 or isinstance(e, RankError) else 1)
        except OutputWriteError as e:  # a save after a length (rank 0's): a full disk, --out changed under the run
            from megatron_ext.disk_space import no_space_message

            said = no_space_message(e, f"--out {args.out}", args.out, e.what, "free space or choose another --out")
            sys.exit(f"error: {said or f'--out {args.out}: {e}; choose another --out'}")
    return 0
