"""Worker: the Megatron NIAH engine at a TP/PP/CP/DP layout on prompts given as JSON.

    torchrun --nproc_per_node=N niah_parallel.py --root CKPT --inputs IN.json --out OUT.json [--tp T --pp P --cp C]

IN.json: {"prompts": [[ids]], "drafts": [[ids]] (one per prompt), "max_new_tokens": n, "eos": [ids], "shared": [[ids]],
"shared_starts": [n]}.
OUT.json (rank 0): greedy predictions after every position of each prompt (one full pass; and through the KV
cache: a prefill, single-token steps, a multi-token step, a step that rolls back cached tokens), each prompt's
per-token losses (as a document for perplexity), and each prompt's continuation with no draft and with the given
drafts, with the forward passes and decode steps each took, with the KV cache and without. Then the prompts of
"shared" (each starting like the one before it, "shared_starts" tokens) through the cache: the predictions after
their positions from the shared prefix on (extension passes, then decode steps), and their greedy continuations.
"""

from __future__ import annotations

import argparse
import json

import torch

# (tokens the pass covers, first position predicted) after a prefill of 26 tokens and 4 wrong ones (a draft the
# model leaves): a step over 8 tokens from 26, steps of one token, one of eight, one going back to position 44
# (tokens 44-47 were cached), and the rest.
CACHED_STEPS = [(34, 26)] + [(n + 1, n) for n in range(34, 40)] + [(48, 40), (55, 44), (61, 55)]


def every_position_cached(gen, ids: list[int]) -> list[list[int]]:
    """[position, predicted token] from each step of `CACHED_STEPS`, the prefill's positions 0 .. 25 first."""
    got = [[p, t] for p, t in enumerate(gen.predict(ids[:26] + [(t + 1) % 500 for t in ids[26:30]], 0)[:26])]
    for end, first in CACHED_STEPS:
        got += [[first + i, t] for i, t in enumerate(gen.predict(ids[:end], first))]
    gen.cache.clear()
    return got


def shared_prefix_steps(gen, first: list[int], shared: list[list[int]], starts: list[int]) -> list[list[list[int]]]:
    """[position, predicted token] of each prompt of `shared` after `first`'s prefill: a pass from its shared
    prefix's end (`starts`; an extension, or a prefill where too little is shared) to 5 tokens before its end,
    then a decode step over one token and one over four."""
    gen.predict(first, 0)
    got = []
    for ids, start in zip(shared, starts):
        n = len(ids)
        steps = [(n - 5, start), (n - 4, n - 5), (n, n - 4)]
        got.append([[p + i, t] for end, p in steps for i, t in enumerate(gen.predict(ids[:end], p))])
    gen.cache.clear()
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    args = ap.parse_args()

    from megatron_ext.evaluate.engine import load_megatron_for_eval
    from megatron_ext.evaluate.parallel import MegatronGreedy, MegatronTokenLosses
    from megatron_ext.runtime import destroy_distributed, init_distributed

    spec = json.loads(open(args.inputs).read())
    init_distributed("cpu", tensor=args.tp, pipeline=args.pp, context=args.cp)
    model, hf_cfg, _ = load_megatron_for_eval(args.root, tensor=args.tp, pipeline=args.pp, context=args.cp)
    gen = MegatronGreedy(model, hf_cfg["vocab_size"], spec["max_new_tokens"], spec["eos"], kv_cache=False)
    out: dict = {"every_position": [gen.predict(ids, 0) for ids in spec["prompts"]]}
    cached = MegatronGreedy(model, hf_cfg["vocab_size"], spec["max_new_tokens"], spec["eos"])
    out["every_position_cached"] = [every_position_cached(cached, ids) for ids in spec["prompts"]]
    out["cached_counts"] = [cached.passes, cached.decode_steps]
    losses = MegatronTokenLosses(model)
    out["losses"] = [losses(torch.tensor(ids)).tolist() for ids in spec["prompts"]]
    prompts = torch.tensor(spec["prompts"])
    for generator, suffix in ((gen, ""), (cached, "_cached")):
        for name, drafts in (("no_draft", None), ("draft", spec["drafts"])):
            generator.passes = generator.decode_steps = 0
            if generator.cache is not None:
                generator.cache.clear()  # the counts below start from nothing cached (the rows repeat)
            out[name + suffix] = generator(prompts, drafts)
            counts = torch.tensor([generator.passes, generator.decode_steps])
            torch.distributed.all_reduce(counts)  # every rank of a replica counts its replica's passes
            out[name + suffix + "_counts"] = (counts // (args.tp * args.pp * args.cp)).tolist()
    cached.passes = cached.decode_steps = 0
    cached.max_decode_tokens = 4  # these prompts are short: more would make the extensions decode steps
    out["shared_every_position"] = shared_prefix_steps(cached, spec["prompts"][0], spec["shared"],
                                                       spec["shared_starts"])
    out["shared_counts"] = [cached.passes, cached.extensions, cached.shared_tokens, cached.decode_steps]
    cached.passes = cached.extensions = 0
    out["shared_greedy"] = cached(spec["shared"])
    counts = torch.tensor([cached.passes, cached.extensions])
    torch.distributed.all_reduce(counts)
    out["shared_greedy_counts"] = (counts // (args.tp * args.pp * args.cp)).tolist()
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
