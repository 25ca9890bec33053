"""Worker: every rank builds CPT datasets (index caches in --cache), rank 0 then plants a pickle as the train shuffle
index, and every rank builds again, as a trainer restarted over a tampered shared cache folder would.

    torchrun --nproc_per_node=2 data_cache_files.py --prefix P --cache DIR --marker FILE --out FILE

The pickle, when unpickled, creates MARKER.<RANK>. Rank r writes OUT.r (JSON): {"error": [type, message] of the
second build (null when none), "vetted": calls of check_index_caches on this rank, "samples": tokens of some samples
of the first build}.
"""

import argparse
import json
from pathlib import Path

import torch.distributed as dist

import megatron_ext.data.loaders as loaders
from megatron_ext.data import build_cpt_datasets


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import os; open({self.marker!r} + '.' + os.environ.get('RANK', '-'), 'w').close()",)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    vetted = [0]
    real = loaders.check_index_caches

    def counted(folders):
        vetted[0] += 1
        return real(folders)

    loaders.check_index_caches = counted
    train = build_cpt_datasets(args.prefix, 32, seed=3, cache_dir=args.cache)[0]
    samples = [train[i]["tokens"].tolist() for i in range(0, len(train), 7)]
    dist.barrier()
    if dist.get_rank() == 0:
        import pickle

        (shuffle,) = Path(args.cache).glob("*-GPTDataset-train-shuffle_index.npy")
        shuffle.write_bytes(pickle.dumps(Payload(args.marker)))
    dist.barrier()
    error = None
    try:
        build_cpt_datasets(args.prefix, 32, seed=3, cache_dir=args.cache)
    except Exception as e:  # noqa: BLE001 -- the test asserts its type
        error = [type(e).__name__, str(e)]
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        json.dump({"error": error, "vetted": vetted[0], "samples": samples}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
