#!/usr/bin/env python
"""Prepare training data: `cpt` (corpus -> Megatron indexed dataset) and `sft` (chat data + loss masks).

See `megatron_ext/data/__init__.py` for usage and the output layout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prepare_data.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    toy = sub.add_parser("toy", help="write offline toy inputs: a 512-token tokenizer, a corpus and chats (README, "
                                     "\"The whole chain by hand, offline, at toy scale\")")
    toy.add_argument("--out", required=True, metavar="DIR", help="writes DIR/tokenizer/, DIR/corpus.jsonl, "
                                                                 "DIR/chats.jsonl")
    toy.add_argument("--documents", type=int, default=300, help="corpus documents (default 300: ~120K tokens)")
    toy.add_argument("--chats", type=int, default=200, help="conversations (default 200)")
    toy.add_argument("--seed", type=int, default=0)
    for name, help_ in (("cpt", "tokenize a corpus for continued pretraining"),
                        ("sft", "render, mask and tokenize chat data for SFT")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--input", nargs="+", required=True, metavar="SRC",
                       help=".jsonl/.json (JSON Lines: one object per line)/.parquet/.txt(.gz) files; folders of "
                            "them (every such file in the folder and its subfolders, hidden ones aside, all of one "
                            "type, in sorted order; other files are named in a warning and not read); or Hugging "
                            "Face hub dataset names (NAME[:split])")
        s.add_argument("--tokenizer", required=True, help="HF fast tokenizer folder or hub name")
        s.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin/.idx/.json")
        s.add_argument("--seed", type=int, default=1234)
        s.add_argument("--workers", type=int, default=0, help="tokenizer threads (0: all cores)")
        s.add_argument("--force", action="store_true", help="overwrite an existing PREFIX")
        s.add_argument("--quiet", action="store_true", help="no progress bar and no summary line (warnings and "
                                                             "errors still print)")
        if name == "cpt":
            s.add_argument("--text-field", default="text", help="dotted field holding the text (default: text)")
            s.add_argument("--source-field", default=None,
                           help="dotted field naming the source, e.g. meta.source (default: the input's name)")
            s.add_argument("--separator", default="<s>",
                           help="literal text after every document (default '<s>'), 'bos-eos' or 'none'")
            s.add_argument("--upsample", default=None, help="[SOURCE:]ltN|gtN|all=RATE,... e.g. 'lt4k=0.5,gt8k=2.0'")
            s.add_argument("--max-tokens", type=int, default=None,
                           help="stop after the document (with its upsampled copies) that reaches this many tokens: "
                                "documents are never cut, so the corpus can exceed it by one document's tokens")
            s.add_argument("--seq-length", type=int, default=None,
                           help="optional: fail unless the corpus fills one sequence of this length")
        else:
            s.add_argument("--seq-length", type=int, required=True, help="drop samples longer than this")
            s.add_argument("--messages-field", default=None,
                           help="dotted field holding the list of {role, content} messages (default: messages, or "
                                "conversations where a row has no messages; ShareGPT's {from, value} turns are read "
                                "too)")
            s.add_argument("--answer-field", default=None, metavar="FIELD",
                           help="dotted field holding the reply to the last message, kept apart from the messages "
                                "(AceMath-Instruct, the paper's SFT source: --answer-field answer); it becomes the "
                                "last assistant turn")
            s.add_argument("--max-samples", type=int, default=None, metavar="N",
                           help="keep N rows drawn uniformly at random with --seed (the paper subsampled ~100K), "
                                "before dropping those too long or without a reply")
            s.add_argument("--chat-template", default="llama3.1", help="llama3.1 | tokenizer | FILE.jinja")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "toy":
        return _write_toy(args)
    if args.workers < 0:
        sys.exit(f"error: --workers {args.workers}: must be 0 (all cores) or a positive number of tokenizer threads")
    if args.workers > 0:  # must precede the tokenizers library's first parallel call
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    # Megatron-Core warns at import about optional GPU libraries; irrelevant to data preparation.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    from megatron_ext.runtime.held_signals import interrupts_held
    from megatron_ext.runtime.signals import interrupted_as_it_started, sigterm_as_interrupt

    try:  # numpy, the tokenizers, Megatron-Core: a signal in their imports was a bare traceback (-2) or a silent -15
        with sigterm_as_interrupt(), interrupts_held():
            from megatron_ext.data import DataError, prepare_cpt, prepare_sft
            from megatron_ext.disk_space import no_space_message
    except KeyboardInterrupt as e:
        return interrupted_as_it_started(e, "nothing was written")

    common = dict(seed=args.seed, force=args.force, progress=not args.quiet)
    try:
        # scancel / kill send SIGTERM: run the Ctrl-C cleanup (atomic_outputs removes the PREFIX.*.tmpPID files,
        # corpus-sized at scale)
        with sigterm_as_interrupt():
            if args.cmd == "cpt":
                prepare_cpt(args.input, args.tokenizer, args.output, text_field=args.text_field,
                            source_field=args.source_field, separator=args.separator, upsample=args.upsample,
                            max_tokens=args.max_tokens, seq_length=args.seq_length, **common)
            else:
                prepare_sft(args.input, args.tokenizer, args.output, args.seq_length,
                            messages_field=args.messages_field, answer_field=args.answer_field,
                            max_samples=args.max_samples, chat_template=args.chat_template, **common)
    except DataError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk, a quota: atomic_outputs has removed the PREFIX.* temporaries
        traceback.clear_frames(e.__traceback__)  # closes the files its frames hold: their space is free again
        said = no_space_message(e, f"--output {args.output}", args.output, "the unfinished output was removed "
                                f"(--output {args.output} is written only by a complete run)",
                                "free space or choose another --output")
        if said is None:
            raise
        sys.exit(f"error: {said}")
    except KeyboardInterrupt as e:
        return _interrupted(e, f"the unfinished output was removed (--output {args.output} is written only by a "
                               "complete run)")
    return 0


def _interrupted(e: KeyboardInterrupt, outcome: str) -> int:
    """The one line of a run stopped by Ctrl-C or SIGTERM (`outcome`: what became of its output); its exit status."""
    from megatron_ext.runtime.signals import Terminated

    print(f"error: interrupted ({'SIGTERM' if isinstance(e, Terminated) else 'Ctrl-C'}); {outcome}", file=sys.stderr)
    return 143 if isinstance(e, Terminated) else 130


_TOY_STAGE = ".partial"  # where `toy` writes before its --out is complete


def _write_toy(args: argparse.Namespace) -> int:
    """The offline toy inputs, written into a staging folder (beside --out, or inside it where it is an empty
    folder) and renamed into place when complete: an interrupt or a failure leaves no half-written --out (which a
    rerun then refused as not empty)."""
    if args.documents < 1 or args.chats < 1:
        sys.exit(f"error: --documents {args.documents} / --chats {args.chats}: both must be positive")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(p.name != _TOY_STAGE for p in out.iterdir())):
        sys.exit(f"error: --out {out}: {'not empty' if out.is_dir() else 'not a folder'}; give a new folder")
    from megatron_ext.cli_types import folder_write_problem
    from megatron_ext.runtime.held_signals import interrupts_held
    from megatron_ext.runtime.signals import interrupted_as_it_started, sigterm_as_interrupt

    problem = folder_write_problem(out)  # before the tokenizer is trained, not as a traceback from its save
    if problem:
        sys.exit(f"error: --out {out}: {problem}")
    try:  # numpy, tokenizers, transformers: a signal in their imports was a bare traceback (-2) or a silent -15
        with sigterm_as_interrupt(), interrupts_held():
            for heavy in ("tokenizers", "transformers"):  # build_toy_tokenizer's, imported with the signals held
                importlib.import_module(heavy)
            from megatron_ext.data import toy
            from megatron_ext.disk_space import no_space_message
    except KeyboardInterrupt as e:
        return interrupted_as_it_started(e, "nothing was written")

    # An existing (empty) --out stays, e.g. `--out .`: a folder renamed over it would leave the shell there in a
    # deleted folder; its parent may not be writable either.
    target = out.absolute()
    stage = target / _TOY_STAGE if target.is_dir() else target.parent / f".{target.name}{_TOY_STAGE}"
    try:
        with sigterm_as_interrupt():
            shutil.rmtree(stage, ignore_errors=True)  # a killed run's
            written = toy.write_toy_inputs(stage, documents=args.documents, chats=args.chats, seed=args.seed)
            if stage.parent == target:
                for part in stage.iterdir():
                    os.replace(part, target / part.name)
                stage.rmdir()
            else:
                os.replace(stage, target)
    except KeyboardInterrupt as e:
        shutil.rmtree(stage, ignore_errors=True)
        return _interrupted(e, f"nothing was written (--out {out} is made only by a complete run)")
    except OSError as e:
        shutil.rmtree(stage, ignore_errors=True)
        said = no_space_message(e, f"--out {out}", out, "the unfinished output was removed", "free space or "
                                "choose another --out")
        if said is None:
            raise
        sys.exit(f"error: {said}")
    print("wrote " + ", ".join(str(out / p.relative_to(stage)) for p in written.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    from megatron_ext.runtime.signals import exit_after_main

    exit_after_main(main())  # a Ctrl-C while Python exits (a second) changes the outcome no more
