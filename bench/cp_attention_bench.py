"""Time and peak memory of torch-SDPA context-parallel attention per zigzag chunk against one dense-mask call.

    python bench/cp_attention_bench.py [--seq 4096] [--cp 4] [--rank 0] [--heads 8] [--kv-heads 2]
                                       [--head-dim 64] [--dtype fp32|bf16] [--device cpu|cuda] [--iters 3]

What one CP rank computes in one attention layer of `TorchSDPAttention` (megatron_ext/attention.py), on one
process: its zigzag queries `[1, heads, seq / cp, d]` against the whole sequence's keys and values
`[1, kv_heads, seq, d]` (already all-gathered), forward + backward with an upstream gradient of ones. The
baseline (`dense_mask`) is measured in the same run: one SDPA call with a boolean `[seq / cp, seq]` causal mask
on global positions (what `TorchSDPAttention` did before; CUDA flash attention takes no mask).
`per_chunk` is `zigzag_causal_attention`: one call per chunk with a lower-right causal bias. Reported: median
seconds of `--iters` steps after one warm-up, peak bytes allocated during a step above its start (CUDA:
`max_memory_allocated`; CPU: the profiler's allocator events), both as ratios to the baseline, and the largest
difference of output and gradients to the baseline's. Out of memory is recorded, not raised. Writes a JSON under
bench/results/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(attend, q, k, v, iters: int, device: str) -> dict:
    """Median step seconds, peak bytes of one step, and the output and gradients of the last step; or out of memory."""
    import torch

    from bench.measure import step_time_and_peak

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = attend(qq, kk, vv)
        out.backward(torch.ones_like(out))
        return out.detach(), qq.grad, kk.grad, vv.grad

    try:
        return {"status": "ok", **step_time_and_peak(step, iters, device)}
    except torch.OutOfMemoryError as err:
        if device == "cuda":
            torch.cuda.empty_cache()
        return {"status": "oom", "error": str(err).splitlines()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/cp_attention_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if min(args.seq, args.cp, args.heads, args.kv_heads, args.head_dim, args.iters) < 1 or args.heads % args.kv_heads:
        print("error: --seq, --cp, --heads, --kv-heads, --head-dim and --iters must be positive, and --heads a "
              "multiple of --kv-heads", file=sys.stderr)
        return 1
    if args.seq % (2 * args.cp) or not 0 <= args.rank < args.cp:
        print(f"error: --seq {args.seq} must be divisible by 2 x --cp ({2 * args.cp}) and --rank {args.rank} "
              f"lie in [0, {args.cp})", file=sys.stderr)
        return 1

    import torch

    from bench.report import write_json_atomic
    import torch.nn.functional as F

    from megatron_ext.attention import zigzag_causal_attention
    from megatron_ext.context_parallel import cp_positions

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    local = args.seq // args.cp
    q = torch.randn(1, args.heads, local, args.head_dim, generator=gen).to(args.device, dtype)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, generator=gen).to(args.device, dtype)
            for _ in range(2))
    positions = cp_positions(args.seq, args.cp, args.rank).to(args.device)

    def sdpa(qq, kk, vv, mask=None):
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=kk.shape[1] != qq.shape[1])

    def dense_mask(qq, kk, vv):
        mask = positions[:, None] >= torch.arange(args.seq, device=qq.device)[None, :]  # [seq / cp, seq]
        return sdpa(qq, kk, vv, mask)

    def per_chunk(qq, kk, vv):
        return zigzag_causal_attention(sdpa, qq, kk, vv, args.cp, args.rank)

    rows = {name: measure(fn, q, k, v, args.iters, args.device)
            for name, fn in (("dense_mask", dense_mask), ("per_chunk", per_chunk))}
    result = {"bench": "cp_attention", "date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()),
              "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
              **{key: getattr(args, key) for key in ("seq", "cp", "rank", "heads", "kv_heads", "head_dim", "iters")},
              "rows": {}}
    print(f"CP attention, rank {args.rank} of {args.cp}, seq {args.seq}, heads {args.heads}/{args.kv_heads} x "
          f"{args.head_dim}, {args.dtype}, {args.device}")
    print(f"{'path':<12}{'step_s':>9}{'time/dense':>12}{'peak_MB':>10}{'mem/dense':>11}{'out_diff':>11}{'grad_diff':>11}")
    base = rows["dense_mask"]
    for name, r in rows.items():
        row = {key: value for key, value in r.items() if key != "out"}
        result["rows"][name] = row
        if r["status"] != "ok":
            print(f"{name:<12}{r['status']:>9}  {r['error'][:80]}")
            continue
        line = f"{name:<12}{r['step_s']:9.3f}"
        if base["status"] == "ok":
            diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(r["out"], base["out"])]
            row.update(time_ratio=r["step_s"] / base["step_s"], memory_ratio=r["peak_bytes"] / base["peak_bytes"],
                       max_abs_out_diff=diffs[0], max_abs_grad_diff=max(diffs[1:]))
            line += (f"{row['time_ratio']:11.2f}x{r['peak_bytes'] / 1e6:10.1f}{row['memory_ratio']:10.2f}x"
                     f"{diffs[0]:11.2e}{max(diffs[1:]):11.2e}")
        else:
            line += f"{'':>12}{r['peak_bytes'] / 1e6:10.1f}"
        print(line)
    path = Path(args.out) / f"cp_attention-{args.device}-{result['date']}.json"
    write_json_atomic(path, result)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
