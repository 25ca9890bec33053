"""Forward passes and time of NIAH on the Megatron engine: the needle as draft, the KV cache, prompts sharing their
prefix through the cache, vs none of them.

    torchrun --nproc-per-node 2 bench/niah_engine_bench.py --megatron demo_out/sft --cp 2 --chat \
        [--lengths 512,2048] [--depths 0:100:10] [--samples 1] [--max-new-tokens 16] [--out bench/results]

The same grid runs five times on the same ranks (`megatron_ext.evaluate.parallel`): first the baseline, greedy
decoding one full forward pass per new token (no draft, no KV cache), then decoding checked against the expected
answer (draft), then with the prompt's keys and values kept and one decode step per further token (kv_cache), then
both, then both with the cache kept from prompt to prompt so that a prompt runs only its tokens after the haystack
it shares with the one before (+shared_prefix: the engine's default). Reported per mode: accuracy, full passes,
extension passes, decode steps, seconds, and passes and time as ratios to the baseline; the scores must be equal
cell by cell (none changes the output), which the script checks. The draft helps a model that retrieves the
needles, the cache one that does not (a decode step costs a pass over one token; the longer the prompt, the more
that saves), the shared prefix every grid with several depths. Writes a JSON under bench/results/ (rank 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"token_by_token": (False, False, False), "draft": (True, False, False), "kv_cache": (False, True, False),
         "draft+kv_cache": (True, True, False),
         "+shared_prefix": (True, True, True)}  # mode: (draft, KV cache, prompts share their prefix through it)


def engine_parser(description: str) -> argparse.ArgumentParser:
    """Arguments of the Megatron engine benches: the checkpoint, its tokenizer and the layout."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--megatron", required=True, help="Megatron checkpoint (e.g. demo_out/sft after make demo)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    return ap


def main() -> int:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--depths", default="0:100:10")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--chat", action="store_true")
    args = ap.parse_args()

    import torch

    from bench.report import write_json_atomic
    from megatron_ext.evaluate.cli import parse_depths, parse_lengths
    from megatron_ext.evaluate.niah import run_niah
    from megatron_ext.evaluate.engine import megatron_engine

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    rows = []
    with megatron_engine(args.megatron, tensor=args.tp, pipeline=args.pp, context=args.cp,
                         tokenizer=args.tokenizer) as engine:
        for mode, (draft, cache, shared) in MODES.items():
            gen = engine.greedy(args.max_new_tokens, kv_cache=cache)
            gen.takes_drafts = draft
            if not shared:
                gen.min_shared = float("inf")
            start = time.perf_counter()
            result = run_niah(None, engine.tokenizer, lengths, depths, generate=gen, samples=args.samples,
                              chat=args.chat, max_new_tokens=args.max_new_tokens, batch_tokens=max(lengths), progress=False,
                              log=None, allow_beyond_max_positions=True)
            seconds = time.perf_counter() - start
            counts = torch.tensor([gen.passes, gen.extensions, gen.shared_tokens, gen.decode_steps])
            torch.distributed.all_reduce(counts, group=torch.distributed.group.WORLD)
            counts //= args.tp * args.pp * args.cp  # every rank of a replica counted its replica's passes
            rows.append({"mode": mode, "accuracy": result.accuracy, "scores": result.scores, "seconds": seconds,
                         "forward_passes": int(counts[0]), "extension_passes": int(counts[1]),
                         "shared_tokens": int(counts[2]), "decode_steps": int(counts[3]),
                         "prompts": len(result.cells)})
            if gen.cache is not None:
                gen.cache.clear()
        rank0 = engine.rank0
        layout = engine.layout
    base = rows[0]
    changed = [r["mode"] for r in rows if r["scores"] != base["scores"]]
    if changed:
        print(f"error: {', '.join(changed)} changed a score; the decoding is not greedy", file=sys.stderr)
        return 1
    if rank0:
        print(f"{'mode':>15} {'accuracy':>9} {'passes':>7} {'x base':>7} {'extend':>7} {'decode':>7} {'seconds':>8} "
              f"{'x base':>7}")
        for r in rows:
            r["passes_ratio"] = r["forward_passes"] / base["forward_passes"]
            r["time_ratio"] = r["seconds"] / base["seconds"]
            print(f"{r['mode']:>15} {r['accuracy']:>9.1%} {r['forward_passes']:>7} {r['passes_ratio']:>7.2f} "
                  f"{r['extension_passes']:>7} {r['decode_steps']:>7} {r['seconds']:>8.2f} {r['time_ratio']:>7.2f}")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = args.out / f"niah_engine-{stamp}.json"
        write_json_atomic(path, {"checkpoint": args.megatron, "layout": layout, "lengths": lengths, "depths": depths,
                                 "samples": args.samples, "chat": args.chat, "rows": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
