"""Time and peak memory of the chunked loss head against Megatron's (output-layer GEMM + vocab-parallel CE).

    python bench/loss_head_bench.py [--tokens 4096] [--hidden 512] [--vocab 32768] [--chunks 512,2048]
                                    [--dtype fp32|bf16] [--device cpu|cuda] [--iters 3] [--kept 0.3]

One forward + backward of the loss head alone (hidden states [T, 1, h] and the output weight [V, h] in,
per-token loss out, upstream gradient ones) on one process, TP=1. The baseline (`full`) is measured in the same
run: Megatron's path as `GPTModel` runs it (`hidden @ W.T`, then `vocab_parallel_cross_entropy`). Reported:
median seconds of `--iters` timed steps after one warm-up, peak bytes allocated during a step above its
start (CUDA: `max_memory_allocated`; CPU: the profiler's allocator events), both as ratios to the baseline,
and the largest difference of loss and of gradients to the baseline's, relative to the baseline's largest value.
With `--kept F` < 1 (SFT: loss on the answers only) a random fraction F of the tokens carries the loss: every
head's loss is multiplied by that mask, and rows `chunked/N+mask` give the mask to the chunked head, which then
forms no logits for the other tokens. In bf16, rows `chunked/N+main_grad` give the weight an fp32 `main_grad` as
Megatron's DDP does (allocated before the step, as DDP's buffer is): the head adds its weight gradient there.
Writes a JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(head, hidden, weight, labels, iters: int, device: str, main_grad=None) -> dict:
    """Median step seconds, peak bytes of one step, and the loss and gradients of the last step. With `main_grad`
    (fp32, the weight's shape, allocated before: DDP's buffer) the weight carries it as Megatron's DDP sets it up,
    and its gradient is read from there."""
    import torch

    from bench.measure import step_time_and_peak

    def step():
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        if main_grad is not None:
            w.main_grad, w.grad_added_to_main_grad = main_grad.zero_(), False
        loss = head(h, w, labels)
        loss.backward(torch.ones_like(loss))
        if main_grad is not None:
            assert w.grad_added_to_main_grad, "the head did not add into main_grad"
            return loss.detach(), h.grad, main_grad.clone()
        return loss.detach(), h.grad, w.grad

    return step_time_and_peak(step, iters, device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/loss_head_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunks", default="512,2048", help="comma list of chunk sizes (tokens)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--kept", type=float, default=1.0, help="fraction of tokens with a loss (SFT answers); < 1 adds "
                   "rows that give the chunked head the mask")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError:
        chunks = []
    if not chunks or min(chunks) < 1 or min(args.tokens, args.hidden, args.vocab, args.iters) < 1:
        print(f"error: --chunks {args.chunks!r}, --tokens, --hidden, --vocab and --iters must be positive integers",
              file=sys.stderr)
        return 1
    if not 0 < args.kept <= 1:
        print(f"error: --kept {args.kept}: a fraction in (0, 1]", file=sys.stderr)
        return 1

    import torch

    from bench.report import write_json_atomic

    os.environ.setdefault("MASTER_PORT", "29517")
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from megatron_ext.loss_head import vocab_parallel_linear_cross_entropy
    from megatron_ext.runtime import destroy_distributed, init_distributed

    init_distributed(args.device, seed=0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(args.device, dtype)  # [s, b, h]
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden ** 0.5).to(args.device, dtype)
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=gen).to(args.device)  # [b, s]

    mask = (torch.rand(1, args.tokens, generator=gen) < args.kept).to(args.device) if args.kept < 1 else None

    def masked(loss):
        return loss if mask is None else loss * mask

    def full(h, w, lab):  # Megatron's path: [s, b, V] logits, then the CE ([s, b] in, [s, b] out)
        return masked(vocab_parallel_cross_entropy(h @ w.t(), lab.t().contiguous()).t())

    rows = {"full": measure(full, hidden, weight, labels, args.iters, args.device)}
    for c in chunks:
        head = lambda h, w, lab, c=c: masked(  # noqa: E731
            vocab_parallel_linear_cross_entropy(h, w, lab, chunk_tokens=c))
        rows[f"chunked/{c}"] = measure(head, hidden, weight, labels, args.iters, args.device)
        if dtype == torch.bfloat16:  # fp32: DDP's addition costs what the head's own accumulator did
            rows[f"chunked/{c}+main_grad"] = measure(head, hidden, weight, labels, args.iters, args.device,
                                                     main_grad=torch.zeros(weight.shape, device=args.device))
        if mask is not None:
            head = lambda h, w, lab, c=c: vocab_parallel_linear_cross_entropy(  # noqa: E731
                h, w, lab, chunk_tokens=c, loss_mask=mask)
            rows[f"chunked/{c}+mask"] = measure(head, hidden, weight, labels, args.iters, args.device)
    destroy_distributed()

    base = rows["full"]
    result = {"bench": "loss_head", "date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()),
              "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
              "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "iters": args.iters,
              "kept": args.kept,
              "logits_bytes": args.tokens * args.vocab * (2 if dtype == torch.bfloat16 else 4), "rows": {}}
    print(f"loss head, {args.tokens} tokens x h {args.hidden} x V {args.vocab}, {args.dtype}, {args.device}")
    print(f"{'head':<24}{'step_s':>9}{'time/full':>11}{'peak_MB':>10}{'mem/full':>10}{'loss_diff':>12}{'grad_diff':>12}")
    for name, r in rows.items():
        diff_loss, diff_grad = (max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                    for a, b in zip(r["out"][i:j], base["out"][i:j])) for i, j in ((0, 1), (1, 3)))
        row = {"step_s": r["step_s"], "step_s_all": r["step_s_all"], "peak_bytes": r["peak_bytes"],
               "time_ratio": r["step_s"] / base["step_s"], "memory_ratio": r["peak_bytes"] / base["peak_bytes"],
               "max_rel_loss_diff": diff_loss, "max_rel_grad_diff": diff_grad}
        result["rows"][name] = row
        print(f"{name:<24}{row['step_s']:9.3f}{row['time_ratio']:10.2f}x{r['peak_bytes'] / 1e6:10.1f}"
              f"{row['memory_ratio']:9.2f}x{diff_loss:12.2e}{diff_grad:12.2e}")
    path = Path(args.out) / f"loss_head-{result['date']}.json"
    write_json_atomic(path, result)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
