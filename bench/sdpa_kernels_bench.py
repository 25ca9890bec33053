"""Causal GQA attention forward + backward in each torch SDPA kernel, by sequence length, against SDPA's own choice.

    python bench/sdpa_kernels_bench.py [--lengths 1K,2K] [--heads 32] [--kv-heads 8] [--head-dim 128]
                                       [--dtype fp32|bf16] [--device cpu|cuda] [--iters 3] [--budget-s 50]

The attention core of one Llama-3.1-8B layer as `TorchSDPAttention` runs it at CP 1 (q `[1, heads, L, d]`,
k/v `[1, kv_heads, L, d]`, `is_causal`, `enable_gqa`): at 128K tokens it is about 70% of a layer's training
FLOPs, so the kernel decides the MFU of the no-TE path. Each kernel is forced with `sdpa_kernel`: `auto`
(SDPA's choice, what training uses: the baseline), `flash`, `cudnn`, `efficient` (CUDA) or `flash`, `efficient`, `math`
(CPU); a kernel that refuses GQA is recorded as `unsupported` and run again with K/V expanded to all heads
(`+expand`). Reported: median seconds of `--iters` steps after one warm-up, TFLOP/s with the causal count
(`megatron_ext.cost_model.attention_core_train_flops_per_token`), time as a ratio to `auto` at the same
length (to the first kernel that ran, if `auto` did not), peak bytes, the largest output difference to it;
out of memory is recorded as `oom`. A kernel whose predicted time at a length (from its own rate at the
previous length) does not fit `--budget-s` is skipped there; kernels run in the order above, so the baseline
and flash come first. Writes a JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import parse_lengths  # noqa: E402


def kernels(device: str) -> list[str]:
    return ["auto", "flash", "cudnn", "efficient"] if device == "cuda" else ["auto", "flash", "efficient", "math"]


def measure(kernel: str, expand: bool, q, k, v, iters: int, device: str) -> dict:
    """One kernel at one length: the timing row, or why it did not run."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.measure import is_oom, step_time_and_peak

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    groups = q.shape[1] // k.shape[1]

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        k_in, v_in = (t.repeat_interleave(groups, dim=1) for t in (kk, vv)) if expand else (kk, vv)
        out = F.scaled_dot_product_attention(qq, k_in, v_in, is_causal=True, enable_gqa=not expand and groups > 1)
        out.backward(torch.ones_like(out))
        return out.detach(), qq.grad, kk.grad, vv.grad

    try:
        if kernel == "auto":
            return {"status": "ok", **step_time_and_peak(step, iters, device)}
        with sdpa_kernel([backends[kernel]]):
            return {"status": "ok", **step_time_and_peak(step, iters, device)}
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if device == "cuda":
            torch.cuda.empty_cache()
        status = "oom" if is_oom(err) else "unsupported"
        return {"status": status, "error": " ".join(str(err).split())[:300]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/sdpa_kernels_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default=None, help="comma list (8K = 8192); default 8K,32K,128K on cuda, 512,2K on cpu")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=50.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    try:
        lengths = parse_lengths(args.lengths or ("8K,32K,128K" if args.device == "cuda" else "512,2K"))
    except ValueError as err:
        print(f"error: --lengths {args.lengths!r}: {err}", file=sys.stderr)
        return 1
    if min(args.heads, args.kv_heads, args.head_dim, args.iters) < 1 or args.heads % args.kv_heads or min(lengths) < 1:
        print("error: --lengths, --heads, --kv-heads, --head-dim and --iters must be positive, and --heads a "
              "multiple of --kv-heads", file=sys.stderr)
        return 1

    import torch

    from bench.measure import Clock
    from bench.report import write_json_atomic
    from megatron_ext.cost_model import attention_core_train_flops_per_token

    clock = Clock(args.budget_s)
    dtype = torch.bfloat16 if (args.dtype or ("bf16" if args.device == "cuda" else "fp32")) == "bf16" else torch.float32
    result = {"bench": "sdpa_kernels", "date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()), "device": args.device,
              "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              **{key: getattr(args, key) for key in ("heads", "kv_heads", "head_dim", "iters")}, "rows": []}
    path = Path(args.out) / f"sdpa_kernels-{args.device}-{result['date']}.json"
    print(f"causal GQA attention, heads {args.heads}/{args.kv_heads} x {args.head_dim}, {result['dtype']}, {args.device}")
    print(f"{'length':>8} {'kernel':<18}{'status':<12}{'step_s':>9}{'TFLOP/s':>9}{'time/auto':>11}{'peak_GB':>9}{'out_diff':>10}")
    gen = torch.Generator().manual_seed(0)
    per_flop_s: dict[str, float] = {}  # seconds per FLOP of each kernel that ran, to predict the next length
    for L in lengths:
        flops = L * attention_core_train_flops_per_token(args.heads * args.head_dim, L)
        q = torch.randn(1, args.heads, L, args.head_dim, generator=gen).to(args.device, dtype)
        k, v = (torch.randn(1, args.kv_heads, L, args.head_dim, generator=gen).to(args.device, dtype) for _ in range(2))
        base = None
        for kernel in kernels(args.device):
            for expand in (False, True):
                name = kernel + ("+expand" if expand else "")
                rate = per_flop_s.get(name, max(per_flop_s.values(), default=0.0))
                need = (args.iters + 2) * flops * rate  # warm-up, timed steps, the memory step
                if per_flop_s and need > clock.remaining():  # nothing ran yet: nothing to predict from, it runs
                    r = {"status": "skipped", "error": f"time budget: needs ~{need:.0f} s, {clock.remaining():.0f} s left"}
                else:
                    r = measure(kernel, expand, q, k, v, args.iters, args.device)
                if r["status"] == "unsupported" and not expand and args.heads != args.kv_heads:
                    print(f"{L:>8} {name:<18}{r['status']:<12}{r['error'][:70]}")
                    result["rows"].append({"length": L, "kernel": name, **r})
                    continue  # try it with K/V expanded to all heads
                row = {"length": L, "kernel": name, **{key: val for key, val in r.items() if key != "out"}}
                line = f"{L:>8} {name:<18}{r['status']:<12}"
                if r["status"] == "ok":
                    row["tflops"] = flops / r["step_s"] / 1e12
                    per_flop_s[name] = r["step_s"] / flops
                    base = base or r
                    row["time_ratio"] = r["step_s"] / base["step_s"]
                    row["max_abs_out_diff"] = (r["out"][0].float() - base["out"][0].float()).abs().max().item()
                    line += (f"{r['step_s']:9.4f}{row['tflops']:9.1f}{row['time_ratio']:10.2f}x"
                             f"{r['peak_bytes'] / 1e9:9.2f}{row['max_abs_out_diff']:10.1e}")
                else:
                    line += r["error"][:70]
                result["rows"].append(row)
                write_json_atomic(path, result)
                print(line, flush=True)
                break
        del q, k, v
    write_json_atomic(path, result)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
