"""Hugging Face Llama-3.1 <-> Megatron-Core checkpoints.

    python tools/convert.py to-megatron --hf HF_DIR --out MEGATRON_DIR [--dtype bf16|fp32] [--verify]
    python tools/convert.py to-hf --megatron MEGATRON_DIR --out HF_DIR [--iteration N]
        [--rope-preset ultralong-1m|ultralong-2m|ultralong-4m [--rope-preset-differs-ok] | --max-position-embeddings N]
        [--verify]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import traceback
import warnings
from pathlib import Path

# Conversion runs on the CPU (Megatron-Core through megatron_ext's CPU backend), also on a node with GPUs: hide them
# before torch is imported, which the backend needs (megatron_ext/runtime/cpu_backend.py). tools/convert.py imports
# this module first.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

from megatron_ext.runtime.gpu_packages import MEGATRON_FALLBACK_WARNINGS, hide_gpu_packages  # noqa: E402

hide_gpu_packages()  # and Transformer Engine / Apex, before Megatron-Core is imported (cpu_backend.py, P0)


# The library warnings a conversion raises that concern no conversion: (category, message, module), matched as
# warnings.filterwarnings matches them (each regex from the start of the text, the message ignoring case). They broke
# into the progress bar, ~20 lines at a to-hf --verify. Found by running to-megatron / to-hf --verify (tiny HF models,
# trained TP1 and TP2 checkpoints) with `-W default`, Megatron-Core 0.16 and torch 2.13 on the CPU; every other
# warning, also from Megatron-Core and torch.distributed, still shows (tests/unit/test_convert_warnings.py).
HARMLESS_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # Conversion runs on the CPU (CUDA hidden above), where neither GPU library could run: Megatron-Core's torch
    # fallbacks compute the same numbers (--verify compares the logits with transformers'), and no optimizer steps.
    *MEGATRON_FALLBACK_WARNINGS,
    # to-hf reads every shard of any TP x PP layout in this one process on purpose: torch's assumption is right.
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in "
                  r"a single process", r"torch\.distributed\.checkpoint\."),
    # Megatron-Core 0.16 calls torch.distributed.checkpoint's old name of the same loader: its upgrade to make.
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load`",
     r"megatron\.core\.dist_checkpointing\."),
    # The torch_dist format is built on ShardedTensor. torch names the frame that called it: our CPU backend's hook,
    # which forwards Megatron-Core's call (megatron_ext/runtime/cpu_backend.py), or Megatron-Core or torch itself.
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"(megatron_ext\.runtime\.cpu_backend$|megatron\.core\.|torch\.distributed\.)"),
    # Megatron-Core's deprecations of its own internals (shown with `-W default`, `-X dev`, PYTHONWARNINGS): its code
    # calling its own older forms, nothing this tool passes or can change.
    (DeprecationWarning, r"Warning: tp_group is None, using default tp group", r"megatron\.core\.tensor_parallel\."),
    (DeprecationWarning, r"MLP requires ffn_hidden_size, but it was not provided", r"megatron\.core\.transformer\."),
    (DeprecationWarning, r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'\s+module is "
                         r"deprecated", r"megatron\.core\."),
    (DeprecationWarning, r"The following imports from `dynamic_context\.py` will be removed",
     r"megatron\.core\.inference\."),
)


def quiet_library_warnings() -> None:
    """Hide HARMLESS_WARNINGS (for the rest of the process); any other warning still shows."""
    for category, message, module in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _interrupted(e: KeyboardInterrupt, outcome: str) -> int:
    """Print the one line of an interrupted conversion; the exit status a shell gives a process the signal ended."""
    from megatron_ext.runtime.signals import Terminated

    how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
    print(f"error: interrupted ({how}); {outcome}", file=sys.stderr)
    return 143 if isinstance(e, Terminated) else 130


def _error_line(e: Exception, out: Path, removed: str) -> str | None:
    """The one `error:` line for a conversion that failed with `e`, None for a crash (its traceback shows)."""
    from megatron_ext.checkpoint import CheckpointError
    from megatron_ext.checkpoint_space import CheckpointSpaceError
    from megatron_ext.convert import ConvertError
    from megatron_ext.disk_space import no_space_message
    from megatron_ext.runtime import DeviceError

    if isinstance(e, CheckpointSpaceError):  # to-megatron's save ran out of space
        return "error: " + e.say(f"--out {out}", "free space or choose another --out", outcome=removed)
    if isinstance(e, (ConvertError, CheckpointError, DeviceError)):  # DeviceError: to-megatron's process group
        return f"error: {e}"
    if isinstance(e, OSError):  # a full disk, a quota, a file system gone: the unfinished output is removed
        traceback.clear_frames(e.__traceback__)  # closes the output files its frames hold: their space is free again
        if said := no_space_message(e, f"--out {out}", out, removed, "free space or choose another --out"):
            return f"error: {said}"
        where = f" ({e.filename})" if e.filename else ""
        return f"error: {e.strerror or e}{where}; {removed}"
    return None


def _convert(args, to_megatron, to_hf) -> dict:
    if args.cmd == "to-megatron":
        return to_megatron(args.hf, args.out, dtype=args.dtype, verify=args.verify, force=args.force,
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                           tolerance=args.tolerance, progress=not args.no_progress)
    return to_hf(args.megatron, args.out, iteration=args.iteration, rope_preset=args.rope_preset,
                 max_position_embeddings=args.max_position_embeddings, dtype=args.dtype,
                 rope_differs_ok=args.rope_preset_differs_ok,
                 tokenizer=args.tokenizer, verify=args.verify, force=args.force, tolerance=args.tolerance,
                 max_shard_bytes=int(args.max_shard_size_gb * 2**30), progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    from megatron_ext.presets import ROPE_PRESETS  # not through megatron_ext.convert: --help without torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-megatron", help="HF safetensors folder -> Megatron torch_dist checkpoint (iteration 0)")
    a.add_argument("--hf", required=True, type=Path, help="HF model folder (config.json + *.safetensors)")
    a.add_argument("--out", required=True, type=Path, help="checkpoint root to create")
    a.add_argument("--dtype", choices=["bf16", "fp32"], help="stored dtype (default: the HF config's; fp16 is stored as fp32, losslessly)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    b = sub.add_parser("to-hf", help="Megatron checkpoint (any TP/PP) -> HF safetensors folder")
    b.add_argument("--megatron", required=True, type=Path,
                   help="checkpoint root (holds iter_* folders; the latest is read) or one iter_* folder")
    b.add_argument("--out", required=True, type=Path, help="HF folder to create")
    b.add_argument("--iteration", type=int, help="default: latest_checkpointed_iteration.txt")
    b.add_argument("--rope-preset", choices=sorted(ROPE_PRESETS), help="UltraLong YaRN rope + context length: the "
                   "rope the checkpoint was trained with (another one is refused, see --rope-preset-differs-ok)")
    b.add_argument("--rope-preset-differs-ok", action="store_true", help="export --rope-preset's rope although the "
                   "checkpoint was trained with another (e.g. a base model with an UltraLong rope, to evaluate it "
                   "untrained); --verify then checks the weights under the exported rope")
    b.add_argument("--max-position-embeddings", type=int, help="context length to declare (trained length)")
    b.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="output dtype (default: the source model's)")
    b.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the one the checkpoint records); an "
                   "HF model folder also gives the generation config and bos/eos ids where the checkpoint has none")
    b.add_argument("--max-shard-size-gb", type=float, default=5.0)
    for p in (a, b):
        p.add_argument("--verify", action="store_true", help="compare HF and Megatron logits (fp32) and fail if off")
        p.add_argument("--tolerance", type=float, default=1e-4, help="max |logit diff| for --verify")
        p.add_argument("--force", action="store_true", help="replace --out if it is an earlier output of this "
                       "command (or empty); any other folder is refused")
        p.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    # also refused: a positive size that rounds to 0 bytes, nan (every comparison is false) and inf
    if args.cmd == "to-hf" and not (args.max_shard_size_gb * 2**30 >= 1 and math.isfinite(args.max_shard_size_gb)):
        sys.exit(f"error: --max-shard-size-gb {args.max_shard_size_gb}: must be a positive number of GiB per "
                 "safetensors shard (default 5)")
    if not (args.tolerance >= 0 and math.isfinite(args.tolerance)):
        sys.exit(f"error: --tolerance {args.tolerance}: the largest |logit difference| --verify accepts, a number >= 0 "
                 "(default 1e-4)")

    quiet_library_warnings()  # before the imports below: Megatron-Core warns as it is imported
    from megatron_ext.runtime.held_signals import interrupts_held  # these two: the standard library only, no wait
    from megatron_ext.runtime.signals import interrupt_behind, sigterm_as_interrupt

    nothing = f"nothing was written (--out {args.out} is replaced only by a complete conversion)"
    removed = f"the unfinished output was removed (--out {args.out} is replaced only by a complete conversion)"
    imported = False
    # scancel / kill send SIGTERM: run the Ctrl-C cleanup (staged_output removes its model-sized temp folder).
    with sigterm_as_interrupt():
        try:
            with interrupts_held():
                from megatron_ext.convert import to_hf, to_megatron
                from megatron_ext.convert.staging import stagings_begun
                if args.cmd == "to-megatron":  # its process group needs Megatron-Core (another second of imports)
                    importlib.import_module("megatron.core.parallel_state")
            imported, staged = True, stagings_begun()
            report = _convert(args, to_megatron, to_hf)
        except (KeyboardInterrupt, Exception) as e:
            # The checks before the staging write nothing: "removed" is said only once staged_output has begun
            # (and has removed its temporary folder; --out is the old one, or the new one if the signal came after
            # it was complete). No traceback.
            outcome = removed if imported and stagings_begun() > staged else nothing
            interrupt = e if isinstance(e, KeyboardInterrupt) else interrupt_behind(e)
            if interrupt is not None:  # also one wrapped on the way (an import's class body, a checkpoint read)
                return _interrupted(interrupt, outcome)
            said = _error_line(e, args.out, outcome) if imported else None
            if said is None:
                raise
            sys.exit(said)
    for key in ("warning", "rope_changed"):
        if key in report:
            print(f"warning: {report[key]}", file=sys.stderr)
    report["peak_rss_gib"] = round(report.pop("peak_rss_bytes") / 2**30, 3)
    print(json.dumps(report))
    return 0
