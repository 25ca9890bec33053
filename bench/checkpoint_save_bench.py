"""How long a checkpoint save stops training: saves in place against background saves (`checkpoint.async_save`).

    python bench/checkpoint_save_bench.py [--hidden 1024] [--layers 8] [--ffn 4096] [--vocab 32000]
                                          [--saves 3] [--device cpu|cuda] [--fully-reshardable] [--out DIR]
    torchrun --nproc_per_node=2 bench/checkpoint_save_bench.py ...   # DP 2: each rank saves its optimizer slice

Each process builds the model as the trainer does (Megatron-Core GPTModel, DDP, the distributed optimizer with
its fp32 master weights and Adam state after one step) and saves it `--saves` times (after one untimed warm-up save) through the trainer's own
`CheckpointSaver`, first in place (the baseline), then in the background. Reported per mode (medians): `stall_s`,
the time `save` holds the training loop (in place: the whole save; background: planning, staging the state in
host memory and forking the writer), and `in_place_s`, until the folder and `latest` are in place (background:
`finalize(blocking=True)` right after, so the writer has the machine to itself; in training it shares it).
Ratios are to the baseline's stall. Checkpoint size is the bytes of the last folder. `--fully-reshardable` adds
both modes with the optimizer state saved `fully_reshardable` (`checkpoint.optimizer_sharding`: gathered over DP
into the parameters' shapes, so any layout resumes it). Writes a JSON under bench/results/ (rank 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(args, world: int):
    """Model, optimizer and scheduler of a `world`-rank DP run of the tiny preset widened to the arguments."""
    from megatron_ext.model import build_model_from_recipe
    from megatron_ext.recipe import load_recipe
    from megatron_ext.train import build_optimizer, wrap_ddp

    model = {"preset": "tiny", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
             "intermediate_size": args.ffn, "vocab_size": args.vocab, "num_attention_heads": args.hidden // 128,
             "num_key_value_heads": max(1, args.hidden // 512)}
    recipe = load_recipe(raw={"name": "checkpoint_save_bench", "model": model,
                              "train": {"seq_length": 256, "steps": 10, "lr": 1e-4, "global_batch_size": world},
                              "runtime": {"device": args.device}}, world_size=world)
    chunk = build_model_from_recipe(recipe)
    ddp = wrap_ddp(recipe, chunk)
    optimizer, scheduler = build_optimizer(recipe, [ddp])
    ddp.zero_grad_buffer()
    optimizer.step()  # zero gradients: creates the Adam state a real checkpoint holds
    return chunk, optimizer, scheduler


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/checkpoint_save_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024, help="model width (a multiple of 128)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--saves", type=int, default=3, help="saves per mode (median)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--fully-reshardable", action="store_true",
                   help="also time both modes with the optimizer state saved fully_reshardable")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder, removed)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if min(args.hidden, args.layers, args.ffn, args.vocab, args.saves) < 1 or args.hidden % 128:
        print("error: --hidden (a multiple of 128), --layers, --ffn, --vocab and --saves must be positive",
              file=sys.stderr)
        return 1

    os.environ.setdefault("MASTER_PORT", "29519")
    import torch

    from bench.report import write_json_atomic
    from megatron_ext.checkpoint_saver import CheckpointSaver
    from megatron_ext.runtime import destroy_distributed, init_distributed

    init_distributed(args.device, seed=0)
    world, rank0 = torch.distributed.get_world_size(), torch.distributed.get_rank() == 0
    chunk, optimizer, scheduler = build(args, world)
    params = sum(t.numel() for t in chunk.parameters())
    where = [args.dir or (tempfile.mkdtemp(prefix="checkpoint_save_bench.") if rank0 else None)]
    torch.distributed.broadcast_object_list(where)  # every rank writes its part into the same folders
    root = Path(where[0])
    modes = [("in_place", "dp_reshardable"), ("background", "dp_reshardable")]
    if args.fully_reshardable:
        modes += [("in_place fully_reshardable", "fully_reshardable"),
                  ("background fully_reshardable", "fully_reshardable")]
    rows, size = {}, 0
    for mode, sharding in modes:
        saver = CheckpointSaver(root / mode.replace(" ", "_"), keep_last=1, background=mode.startswith("background"),
                                log=lambda _: None, optimizer_sharding=sharding)
        stalls, totals = [], []
        for i in range(args.saves + 1):  # the first one warms up (strategy caches, first fork), not timed
            start = time.perf_counter()
            saver.save(i + 1, [chunk], optimizer=optimizer, scheduler=scheduler, metadata={"hf_config": {}},
                       wait=False)
            stalls.append(time.perf_counter() - start)
            saver.finalize(blocking=True)
            totals.append(time.perf_counter() - start)
        stalls, totals = stalls[1:], totals[1:]
        last = root / mode.replace(" ", "_") / f"iter_{args.saves + 1:07d}"
        size = folder_bytes(last)
        rows[mode] = {"stall_s": statistics.median(stalls), "in_place_s": statistics.median(totals),
                      "stall_s_all": stalls, "in_place_s_all": totals,
                      # shard bytes each rank wrote (__RANK_*.distcp): replicated tensors spread over the ranks
                      "bytes_by_rank": [sum(f.stat().st_size for f in last.glob(f"__{r}_*.distcp"))
                                        for r in range(world)]}
    torch.distributed.barrier()
    if not args.dir and rank0:
        shutil.rmtree(root, ignore_errors=True)
    destroy_distributed()
    if not rank0:
        return 0

    base = rows["in_place"]["stall_s"]
    result = {"bench": "checkpoint_save", "date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()),
              "device": args.device, "torch": torch.__version__, "params": params, "checkpoint_bytes": size,
              "data_parallel": world,
              "hidden": args.hidden, "layers": args.layers, "ffn": args.ffn, "vocab": args.vocab,
              "saves": args.saves, "rows": rows}
    print(f"checkpoint save, {params / 1e6:.0f}M parameters, {size / 2**30:.2f} GiB per checkpoint, {args.device}, "
          f"DP {world}, median of {args.saves}")
    print(f"{'mode':<30}{'stall_s':>9}{'stall/in_place':>16}{'in_place_s':>12}  GB written by rank")
    for mode, row in rows.items():
        row["stall_ratio"] = row["stall_s"] / base
        by_rank = " ".join(f"{b / 1e9:.2f}" for b in row["bytes_by_rank"])
        print(f"{mode:<30}{row['stall_s']:9.3f}{row['stall_ratio']:15.3f}x{row['in_place_s']:12.3f}  {by_rank}")
    path = Path(args.out) / f"checkpoint_save-{args.device}-{result['date']}.json"
    write_json_atomic(path, result)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
