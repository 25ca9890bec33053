"""Worker: what one rank of the tiny model (local spec, torch SDPA, fp32) keeps for backward under context parallelism.

    torchrun --nproc_per_node=4 plan_memory_cp.py --out FILE --cases JSON

JSON: a list of {"cp": CP, "seq": L, "set": [recipe overrides]}; each case runs on CP groups of that size (the
other processes data-parallel replicas). Per rank it measures:
- `saved`: the bytes of the distinct storages the decoder layers save for backward in one forward of the rank's
  L / CP tokens (parameters left out), with `saved_tensors_hooks` entered around each layer's forward;
- `mask`: the part of `saved` that is a materialised [c, k] float mask: torch builds one for a lower-right causal
  chunk where no flash kernel takes it (CPU; on CUDA flash attention takes the chunk with no mask), so it is
  reported apart and not part of what the planner models;
- `attn_backward_peak` (CP > 1): the highest allocation level above its start while one layer's core attention
  runs its backward (torch profiler allocator events), from random local Q/K/V.
"""

import argparse
import json

import torch

from bench.measure import cpu_peak_allocated_bytes
from megatron_ext.context_parallel import shard_for_context_parallel
from megatron_ext.model import build_model_from_recipe
from megatron_ext.recipe import load_recipe
from megatron_ext.runtime import destroy_distributed, init_distributed


def measure(cp: int, seq: int, overrides: list[str]) -> dict:
    from megatron.core import parallel_state

    init_distributed("cpu", context=cp)
    world = torch.distributed.get_world_size()
    rank = parallel_state.get_context_parallel_rank()
    recipe = load_recipe("recipes/tiny/base.yaml", [
        f"train.seq_length={seq}", f"model.max_position_embeddings={seq}", "train.recompute=none",
        f"parallel.context={cp}", f"cluster.gpus_per_node={world}", f"train.global_batch_size={world // cp}",
        *overrides])
    torch.manual_seed(0)
    model = build_model_from_recipe(recipe)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, recipe.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = shard_for_context_parallel({"tokens": tokens, "position_ids": torch.arange(seq)[None]}, cp, rank)
    saved: dict[int, int] = {}
    masks: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
            if t.dim() == 2 and t.is_floating_point() and not t.requires_grad:
                masks[st.data_ptr()] = st.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: hooks.__enter__())
        layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    model(batch["tokens"], batch["position_ids"], None, labels=batch["tokens"]).mean()
    result = {"cp": cp, "seq": seq, "set": overrides, "cp_rank": rank, "saved": sum(saved.values()),
              "mask": sum(masks.values())}
    if cp > 1:
        m = recipe.model
        core = model.decoder.layers[0].self_attention.core_attention
        s, nh, ng, d = seq // cp, m.num_attention_heads, m.num_key_value_heads, m.head_dim or m.hidden_size // m.num_attention_heads
        q, k, v = (torch.randn(s, 1, n, d, requires_grad=True) for n in (nh, ng, ng))
        out = core(q, k, v, None)
        grad = torch.randn_like(out)
        result["attn_backward_peak"] = cpu_peak_allocated_bytes(lambda: out.backward(grad))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True)
    args = ap.parse_args()
    results = []
    for case in json.loads(args.cases):
        mine = measure(case["cp"], case["seq"], case.get("set", []))
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        results.append(everyone)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
