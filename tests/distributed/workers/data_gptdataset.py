"""Worker: build CPT GPTDatasets (single prefix and a weighted blend) under torch.distributed.

    torchrun --nproc_per_node=N data_gptdataset.py --prefix A --prefix2 B --cache DIR --out FILE

Megatron-Core's builder lets rank 0 write the index caches, then the other ranks read them; every
rank must see the same samples. Rank r writes FILE.r (JSON: first tokens of some samples).
"""

import argparse
import json
import os

import torch.distributed as dist

from megatron_ext.data import build_cpt_datasets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--prefix2", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    train = build_cpt_datasets(args.prefix, 32, seed=3, cache_dir=args.cache)[0]
    blend = build_cpt_datasets([args.prefix, args.prefix2], 32, weights=[0.7, 0.3], seed=3,
                               num_samples=(40, None, None), cache_dir=args.cache)[0]
    res = {"len": len(train), "single": [train[i]["tokens"].tolist() for i in range(0, len(train), 7)],
           "blend_len": len(blend), "blend": [blend[i]["tokens"].tolist() for i in range(len(blend))],
           "blend_source": [int(blend.dataset_index[i]) for i in range(len(blend))],
           "cache_files": sorted(os.listdir(args.cache))}
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
