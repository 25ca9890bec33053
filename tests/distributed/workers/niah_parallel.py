"""Worker: the Megatron NIAH engine at a TP/PP/CP/DP layout on prompts given as JSON.

    torchrun --nproc_per_node=N niah_parallel.py --root CKPT --inputs IN.json --out OUT.json [--tp T --pp P --cp C]

IN.json: {"prompts": [[ids]], "drafts": [[ids]] (one per prompt), "max_new_tokens": n, "eos": [ids]}.
OUT.json (rank 0): greedy predictions after every position of each prompt, each prompt's per-token losses (as a
document for perplexity), and each prompt's continuation with no draft and with the given drafts, with the
forward passes each took.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    args = ap.parse_args()

    from megatron_ext.evaluate.parallel import MegatronGreedy, MegatronTokenLosses, load_megatron_for_eval
    from megatron_ext.runtime import destroy_distributed, init_distributed

    spec = json.loads(open(args.inputs).read())
    init_distributed("cpu", tensor=args.tp, pipeline=args.pp, context=args.cp)
    model, hf_cfg, _ = load_megatron_for_eval(args.root, tensor=args.tp, pipeline=args.pp, context=args.cp)
    gen = MegatronGreedy(model, hf_cfg["vocab_size"], spec["max_new_tokens"], spec["eos"])
    out: dict = {"every_position": [gen.predict(ids, 0) for ids in spec["prompts"]]}
    losses = MegatronTokenLosses(model)
    out["losses"] = [losses(torch.tensor(ids)).tolist() for ids in spec["prompts"]]
    prompts = torch.tensor(spec["prompts"])
    for name, drafts in (("no_draft", None), ("draft", spec["drafts"])):
        gen.passes = 0
        out[name] = gen(prompts, drafts)
        passes = torch.tensor([gen.passes])
        torch.distributed.all_reduce(passes)  # every rank of a replica counts its replica's passes
        out[name + "_passes"] = int(passes) // (args.tp * args.pp * args.cp)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
