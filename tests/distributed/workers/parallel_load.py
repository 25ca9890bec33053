"""Worker: a DP 2 checkpoint (model, distributed optimizer, scheduler) loaded by every rank in full and with
`fully_parallel=True`; records what each rank read from the files and whether the state came back exactly.

    torchrun --nproc_per_node=2 parallel_load.py --dir DIR --out FILE_PREFIX

Writes FILE_PREFIX.RANK.json: {"all": {...}, "fully_parallel": {...}, "weight_bytes": N}, each mode with
`bytes_read` (the bytes of the checkpoint's items this rank's reader served) and `mismatched` (state tensors that
differ from the saved ones); `weight_bytes`: the model's weights, which every rank holds whole at DP 2.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.checkpoint_save_bench import build  # noqa: E402  (the trainer's model, DDP and optimizer)
from megatron_ext.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megatron_ext.runtime import destroy_distributed, init_distributed  # noqa: E402


def count_bytes_read() -> list[int]:
    """Make torch's checkpoint reader add the size of every item it reads to the returned counter."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    counter = [0]
    read_data = FileSystemReader.read_data

    def counting_read_data(self, plan, planner):
        counter[0] += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return read_data(self, plan, planner)

    FileSystemReader.read_data = counting_read_data
    return counter


def state_tensors(chunk, optimizer) -> dict[str, torch.Tensor]:
    """The model's parameters and this rank's optimizer state (fp32 main weights, Adam moments), cloned."""
    out = {f"model.{k}": v.detach().clone() for k, v in chunk.state_dict().items() if isinstance(v, torch.Tensor)}
    for i, main_param in enumerate(p for group in optimizer.optimizer.param_groups for p in group["params"]):
        out[f"optimizer.{i}.param"] = main_param.detach().clone()
        state = optimizer.optimizer.state.get(main_param, {})
        out.update({f"optimizer.{i}.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = init_distributed("cpu", seed=1234)
    sizes = argparse.Namespace(hidden=128, layers=2, ffn=256, vocab=512, device="cpu")
    chunk, optimizer, scheduler = build(sizes, world=env.world_size)
    saved = state_tensors(chunk, optimizer)
    save_checkpoint(args.dir, 1, [chunk], optimizer=optimizer, scheduler=scheduler, metadata={"hf_config": {}})
    bytes_read = count_bytes_read()
    result = {}
    for mode, fully_parallel in (("all", False), ("fully_parallel", True)):
        with torch.no_grad():  # forget the state, so that only the load can bring it back
            main_params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
            for p in [*chunk.parameters(), *main_params]:
                p.zero_()
            for state in optimizer.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        value.zero_()
        before = bytes_read[0]
        load_checkpoint(args.dir, [chunk], optimizer=optimizer, scheduler=scheduler, fully_parallel=fully_parallel)
        now = state_tensors(chunk, optimizer)
        result[mode] = {"bytes_read": bytes_read[0] - before,
                        "mismatched": sorted(k for k in saved if not torch.equal(saved[k], now[k])),
                        "tensors": len(saved)}
    result["weight_bytes"] = sum(v.nbytes for k, v in saved.items() if k.startswith("model."))
    Path(f"{args.out}.{env.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
