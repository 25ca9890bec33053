"""Worker: which files of a checkpoint each rank opens while loading it (a resume with the optimizer, an
`init_from` weights-only load), and what each rank raises for a checkpoint that lost a shard.

    torchrun --nproc_per_node=2 checkpoint_load_reads.py --dir DIR --out FILE_PREFIX

Writes FILE_PREFIX.RANK.json: {"resume": {...}, "weights_only": {...}, "incomplete": MESSAGE}, each load with
`check_complete` (the calls of the file-completeness check on this rank) and `opens` (opens of the checkpoint's
files by name, `*.distcp` counted together); MESSAGE: the CheckpointError this rank raised (None: it loaded).
"""

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.checkpoint_save_bench import build  # noqa: E402  (the trainer's model, DDP and optimizer)
from megatron_ext import checkpoint, checkpoint_index  # noqa: E402
from megatron_ext.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from megatron_ext.runtime import destroy_distributed, init_distributed  # noqa: E402


def count_opens(folder: Path) -> collections.Counter:
    """Count every open (Python's and os.open) of a file under `folder`, by name, from now on."""
    opens: collections.Counter = collections.Counter()
    prefix = str(folder.resolve()) + os.sep

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, os.PathLike)):
            path = os.path.abspath(os.fspath(args[0]))
            if path.startswith(prefix):
                name = os.path.basename(path)
                opens["*.distcp" if name.endswith(".distcp") else name] += 1

    sys.addaudithook(hook)
    return opens


def count_calls(module, name: str, calls: list[int]) -> None:
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(module, name, counted)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = init_distributed("cpu", seed=1234)
    sizes = argparse.Namespace(hidden=128, layers=2, ffn=256, vocab=512, device="cpu")
    chunk, optimizer, scheduler = build(sizes, world=env.world_size)
    root = Path(args.dir)
    save_checkpoint(root, 1, [chunk], optimizer=optimizer, scheduler=scheduler, metadata={"hf_config": {}})
    opens, checks = count_opens(root), [0]
    for module in (checkpoint, checkpoint_index):  # wherever the loader calls it from
        count_calls(module, "check_complete", checks)
    result = {}
    for mode, kwargs in (("resume", {"optimizer": optimizer, "scheduler": scheduler}),
                         ("weights_only", {"weights_only": True})):
        torch.distributed.barrier()
        opens.clear()
        checks[0] = 0
        load_checkpoint(root, [chunk], **kwargs)
        result[mode] = {"check_complete": checks[0], "opens": dict(opens)}
    torch.distributed.barrier()
    if env.rank == 0:  # a shard lost (a node's write, a partial copy): every rank must fail, with one message
        sorted((root / "iter_0000001").glob("*.distcp"))[-1].unlink()
    torch.distributed.barrier()
    try:
        load_checkpoint(root, [chunk], weights_only=True)
        result["incomplete"] = None
    except CheckpointError as e:
        result["incomplete"] = str(e)
    Path(f"{args.out}.{env.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
