"""Worker: how often each rank hashes each PREFIX.idx at a trainer's start: rank 0 records the data identities
(`resume.data_identities`, as train.py does), then every rank builds the CPT datasets (one prefix, then a blend).

    torchrun --nproc_per_node=2 data_index_hashes.py --prefix A --prefix2 B --cache DIR --out FILE

Rank r writes FILE.r (JSON): {"hashes": {PREFIX: full sha256 passes over PREFIX.idx}, "single": [...],
"blend": [...]} (tokens of some samples, which every rank must see alike).
"""

import argparse
import hashlib
import json
from pathlib import Path

import torch.distributed as dist

from megatron_ext.data import build_cpt_datasets
from megatron_ext.data.dataset_files import data_identity


def count_index_hashes(prefixes: list[str]) -> dict[str, int]:
    """Count, by prefix, the sha256 objects fed a whole PREFIX.idx, alone or among other bytes (what reading it to
    hash it costs) from now on."""
    contents = {Path(p + ".idx").read_bytes(): p for p in prefixes}
    most = sum(map(len, contents))
    counts = dict.fromkeys(prefixes, 0)
    real = hashlib.sha256

    class Counted:
        def __init__(self, data=b"", **kwargs):
            self.h, self.fed = real(**kwargs), bytearray()
            self.update(data)

        def update(self, data):
            if self.fed is not None:  # longer than the index files together: not what we count
                self.fed = self.fed + data if len(self.fed) + len(data) <= most else None
            self.h.update(data)

        def hexdigest(self):
            for content, prefix in contents.items():
                counts[prefix] += self.fed is not None and content in self.fed
            return self.h.hexdigest()

        def __getattr__(self, name):
            return getattr(self.h, name)

    hashlib.sha256 = Counted
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--prefix2", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    counts = count_index_hashes([args.prefix, args.prefix2])
    if dist.get_rank() == 0:  # train.py: rank 0 alone records what the data holds
        identities = {p: data_identity(p) for p in (args.prefix, args.prefix2)}
        assert all(identities.values()), identities
    train = build_cpt_datasets(args.prefix, 32, seed=3, cache_dir=args.cache)[0]
    blend = build_cpt_datasets([args.prefix, args.prefix2], 32, weights=[0.7, 0.3], seed=3,
                               num_samples=(40, None, None), cache_dir=args.cache)[0]
    res = {"hashes": counts, "single": [train[i]["tokens"].tolist() for i in range(0, len(train), 7)],
           "blend": [blend[i]["tokens"].tolist() for i in range(len(blend))]}
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
