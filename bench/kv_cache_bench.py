"""Time of one decode step through the Megatron engine's KV cache vs a full pass over the sequence, by length.

    torchrun --nproc-per-node 2 bench/kv_cache_bench.py --megatron demo_out/sft --cp 2 [--lengths 2K,8K,32K]
        [--steps 8] [--out bench/results]

For each length L, on the same ranks: the baseline is a forward pass over L tokens that predicts the next token
(what the engine does per token without a cache, `--no-kv-cache`); then one prefill pass that records the cache,
and `--steps` decode steps of one token each. Reported: medians of the full pass and the decode step (one
warm-up each), their ratio, and whether the decode steps predict what full passes over the same tokens predict
(checked for every step). Writes a JSON under bench/results/ (rank 0).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from bench.niah_engine_bench import engine_parser

    ap = engine_parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2K,8K,32K")
    ap.add_argument("--steps", type=int, default=8, help="decode steps (and full passes) timed per length")
    args = ap.parse_args()

    import torch

    from bench.report import write_json_atomic
    from megatron_ext.evaluate.cli import parse_lengths
    from megatron_ext.evaluate.engine import megatron_engine

    lengths = parse_lengths(args.lengths)
    rows = []
    with megatron_engine(args.megatron, tensor=args.tp, pipeline=args.pp, context=args.cp, tokenizer=args.tokenizer,
                         needs_tokenizer=False) as engine:
        full = engine.greedy(1, kv_cache=False, until_number=False)
        cached = engine.greedy(1, until_number=False)
        vocab = engine.hf_config["vocab_size"]
        for length in lengths:
            ids = torch.randint(3, vocab, (length + args.steps,), generator=torch.Generator().manual_seed(length))
            ids = ids.tolist()

            def timed(gen, end):
                torch.distributed.barrier()
                start = time.perf_counter()
                token = gen.predict(ids[:end], end - 1)
                torch.distributed.barrier()
                return time.perf_counter() - start, token

            full_runs = [timed(full, length + i) for i in range(args.steps + 1)]  # the first one warms up
            cached.predict(ids[:length], length - 1)  # the prefill
            step_runs = [timed(cached, length + i + 1) for i in range(args.steps)]
            cached.cache.clear()
            same = [a[1] == b[1] for a, b in zip(full_runs[1:], step_runs)]  # both predict after the same tokens
            full_s = statistics.median(t for t, _ in full_runs[1:])
            step_s = statistics.median(t for t, _ in step_runs[1:])
            rows.append({"length": length, "full_pass_s": full_s, "decode_step_s": step_s, "ratio": step_s / full_s,
                         "same_predictions": all(same), "steps": args.steps})
        rank0, layout = engine.rank0, engine.layout
    if not all(r["same_predictions"] for r in rows):
        print("error: a decode step predicted another token than the full pass over the same tokens", file=sys.stderr)
        return 1
    if rank0:
        print(f"{'length':>8} {'full pass s':>12} {'decode step s':>14} {'step/pass':>10}")
        for r in rows:
            print(f"{r['length']:>8,} {r['full_pass_s']:>12.4f} {r['decode_step_s']:>14.4f} {r['ratio']:>10.4f}")
        path = args.out / f"kv_cache-{time.strftime('%Y%m%d-%H%M%S')}.json"
        write_json_atomic(path, {"checkpoint": args.megatron, "layout": layout, "rows": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
