"""Command line of the FP8 export (`tools/quantize.py`); see `main`."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from megatron_ext.quantize.errors import QuantizeError
from megatron_ext.runtime.held_signals import interrupts_held
from megatron_ext.runtime.signals import Terminated, sigterm_as_interrupt

DEFAULT_SEQ_CAP = 32768


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/quantize.py",
        description="FP8 post-training quantization (weights, activations, KV cache) of an HF Llama checkpoint "
                    "with NVIDIA ModelOpt, calibrated on long samples, exported for vLLM / TensorRT-LLM.")
    p.add_argument("--hf", required=True, help="Hugging Face model directory (e.g. from tools/convert.py to-hf)")
    p.add_argument("--out", required=True, help="output directory for the quantized checkpoint (must not exist)")
    p.add_argument("--weights", choices=("fp8", "none"), default="fp8", help="linear layers: FP8 E4M3 (default)")
    p.add_argument("--kv-cache", choices=("fp8", "none"), default="fp8", help="KV cache: FP8 with k/v scales (default)")
    p.add_argument("--calib", required=True,
                   help="calibration data: indexed dataset PREFIX (PREFIX.bin/.idx), a .txt/.jsonl file or "
                        "directory, or a Hugging Face dataset name[:config]")
    p.add_argument("--calib-samples", type=int, default=8, help="calibration windows (default 8)")
    p.add_argument("--calib-seq-length", type=int, default=None,
                   help=f"tokens per window (default: max_position_embeddings, at most {DEFAULT_SEQ_CAP:,})")
    p.add_argument("--calib-split", default="train", help="split of a Hugging Face dataset (default train)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --hf)")
    p.add_argument("--check", action="store_true",
                   help="compare the fake-quant model with the original on held-out windows (perplexity, "
                        "logits error, NIAH) and do not export when it fails")
    p.add_argument("--check-samples", type=int, default=2, help="held-out windows for --check (default 2)")
    p.add_argument("--no-niah", action="store_true", help="--check without NIAH")
    p.add_argument("--max-ppl-increase", type=float, default=0.05, help="--check limit, fraction (default 0.05)")
    p.add_argument("--max-logits-rel-err", type=float, default=0.15, help="--check limit (default 0.15)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="dtype to load, calibrate and export in (default: as stored)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    return p


def _check_device(device: str | None) -> None:
    """The evaluation tool's --device check (cpu, cuda, cuda:N on a visible GPU), as this tool's error."""
    from megatron_ext.evaluate.loading import check_device
    from megatron_ext.runtime import DeviceError

    try:
        check_device(device)
    except DeviceError as e:
        raise QuantizeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """Quantize, check, export and report; returns the exit status (1: the check failed)."""
    from megatron_ext.runtime.gpu_packages import hide_megatron_fallback_warnings

    hide_megatron_fallback_warnings()  # 6 warnings (12 lines) from the import of nvidia-modelopt, before any output
    # torch's and ModelOpt's imports (seconds) with a Ctrl-C / SIGTERM held until they are done: raised inside them
    # it was a traceback, or lost in the import machinery ('Exception ignored in ... _get_module_lock') and the run
    # went on (runtime/held_signals.py)
    with interrupts_held():
        from megatron_ext.quantize import calib, check, fp8, report

    for flag, limit in (("--max-ppl-increase", args.max_ppl_increase), ("--max-logits-rel-err", args.max_logits_rel_err)):
        if not limit >= 0:  # nan too
            raise QuantizeError(f"{flag} {limit}: a limit of the --check comparison, a number >= 0")
    defaults = parser()
    check_only = {flag: flag[2:].replace("-", "_") for flag in ("--no-niah", "--check-samples", "--max-ppl-increase",
                                                                 "--max-logits-rel-err")}
    unused = [flag for flag, dest in check_only.items() if getattr(args, dest) != defaults.get_default(dest)]
    if unused and not args.check:
        raise QuantizeError(f"{unused[0]} sets the accuracy check, which runs with --check only: add --check")
    # 0 meant the default (`or`), where every other tool of the stack refuses it
    if args.calib_seq_length is not None and args.calib_seq_length < 2:
        raise QuantizeError(f"--calib-seq-length {args.calib_seq_length}: tokens per calibration window, a number "
                            f">= 2 (default: the model's max_position_embeddings, at most {DEFAULT_SEQ_CAP:,})")
    if args.calib_samples < 1:
        raise QuantizeError(f"--calib-samples {args.calib_samples}: the calibration windows, a number >= 1 "
                            "(default 8)")
    if args.check and args.check_samples < 1:  # an IndexError after the whole calibration
        raise QuantizeError(f"--check-samples {args.check_samples}: the held-out windows --check compares, a "
                            "number >= 1")
    # before ModelOpt's import (~20 s)
    if Path(args.out).exists():
        raise QuantizeError(f"--out {args.out} exists: remove it or choose a new directory")
    from megatron_ext.cli_types import folder_write_problem

    # the export writes beside --out: found here, not after minutes of calibration (os.access says yes to root)
    problem = folder_write_problem(args.out)
    if problem:
        raise QuantizeError(f"--out {args.out}: {problem}")
    hf_cfg = fp8.read_hf_config(args.hf)
    with interrupts_held():
        version, mtq, _ = fp8.modelopt()
    fp8.quant_config(mtq, args.weights, args.kv_cache, version)  # option and version errors before loading
    _check_device(args.device)
    seq = args.calib_seq_length
    if seq is None:
        seq = min(int(hf_cfg.get("max_position_embeddings") or DEFAULT_SEQ_CAP), DEFAULT_SEQ_CAP)
    t0 = time.time()
    tokenizer = fp8.load_tokenizer(args.tokenizer or args.hf, required=bool(args.tokenizer))
    # data errors (too short, wrong vocabulary) before the model load, which takes minutes at 8B
    windows, held = calib.load_windows(args.calib, samples=args.calib_samples, seq_length=seq,
                                       held_out=args.check_samples if args.check else 0, tokenizer=tokenizer,
                                       vocab_size=int(hf_cfg["vocab_size"]), split=args.calib_split,
                                       tokenizer_name=args.tokenizer or args.hf)
    model = fp8.load_model(args.hf, args.dtype, args.device)
    print(f"[quantize] ModelOpt {version}: {args.calib_samples} calibration windows of {seq:,} tokens from {args.calib}")
    fp8.quantize(model, windows, args.weights, args.kv_cache)
    layers = fp8.quantized_layers(model)
    result = None
    if args.check:
        result = check.run_check(model, held, tokenizer, max_ppl_increase=args.max_ppl_increase,
                                 max_logits_rel_err=args.max_logits_rel_err, niah=not args.no_niah)
        print(f"[quantize] check on {len(held)} held-out windows of {seq:,} tokens (fake-quant FP8 vs original):")
        print(check.format_table(result))
        if not result.passed:
            print(f"error: the FP8 model failed the accuracy check, {args.out} not written (raise "
                  "--max-ppl-increase / --max-logits-rel-err, or --no-niah where NIAH failed, to accept it)",
                  file=sys.stderr)
            return 1
    summary = {"source": str(args.hf), "modelopt": version, "weights": args.weights, "kv_cache": args.kv_cache,
               "calib": {"data": args.calib, "samples": args.calib_samples, "seq_length": seq},
               "layers": layers, "check": result.to_dict() if result else None}
    out = fp8.export(model, args.out, tokenizer, {"quantize_report.json": json.dumps(summary, indent=2)})
    if tokenizer is None:
        print(f"warning: {args.hf} has no tokenizer and none was given (--tokenizer): {out} holds none, and "
              "vLLM needs one beside the weights", file=sys.stderr)
    if args.weights == "none":
        print("warning: a KV-cache-only export has no quant_algo in its quantization_config, which vLLM's ModelOpt "
              "reader asks for; serve it with TensorRT-LLM, or export with --weights fp8 for vLLM", file=sys.stderr)
    in_b, out_b = fp8.checkpoint_bytes(args.hf), fp8.checkpoint_bytes(out)
    print(report.format_report(hf_cfg, layers, in_b, out_b, args.kv_cache, args.weights))
    print(f"[quantize] wrote {out} in {time.time() - t0:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors end as one `error: ...` line and exit status 2; Ctrl-C as one line and 130,
    SIGTERM 143."""
    args = parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
    try:
        with sigterm_as_interrupt():  # scancel: the export's temporary folder is removed as on Ctrl-C
            return run(args)
    except QuantizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # the export's temporary folder is gone (fp8.export): nothing is half-written
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        print(f"error: interrupted ({how}); nothing was written (--out {args.out} is written only by a complete "
              "run): run it again", file=sys.stderr, flush=True)
        return 143 if isinstance(e, Terminated) else 130
