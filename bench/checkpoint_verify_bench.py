"""`tools/checkpoint.py info --verify`'s read of a checkpoint (every stored item's CRC-32) against reading the same
files and computing their CRC-32 with nothing else (zlib, the least any check of every byte costs), and against
torch's own load of them (which checks no CRC).

    python bench/checkpoint_verify_bench.py [--gib 1] [--tensors 8] [--repeats 3] [--out bench/results]

Writes a torch_dist checkpoint of `--tensors` random fp32 tensors, `--gib` GiB in all
(`torch.distributed.checkpoint`, one process), into a temporary folder; reads it once to warm the page cache (all
three read from memory then: the rate of the code, not of the disk); times each way `--repeats` times (median).
Writes a JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _crc_of_files(files: list[Path]) -> int:
    crc = 0
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(16 << 20):
                crc = zlib.crc32(chunk, crc)
    return crc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size (GiB)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    from bench.report import write_json_atomic
    from megatron_ext.checkpoint_damage import verify_contents

    numel = int(args.gib * 2**30 / 4 / args.tensors)
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        folder = Path(tmp) / "ckpt"
        state = {f"t{i}": torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(args.tensors)}
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        files = sorted(folder.glob("*.distcp"))
        size = sum(f.stat().st_size for f in files)
        _crc_of_files(files)  # into the page cache

        def index():  # torch's reader: plain DCP records its folder as a Path, which read_dcp_index's list refuses
            return dcp.FileSystemReader(str(folder)).read_metadata()

        def load() -> None:
            target = {k: torch.empty_like(v) for k, v in state.items()}
            dcp.load(target, checkpoint_id=str(folder), no_dist=True)

        ways = {"read + zlib.crc32": lambda: _crc_of_files(files),
                "verify_contents": lambda: verify_contents(folder, index(), progress=False),
                "torch dcp.load": load}
        rows = {}
        for name, run in ways.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = run()
                times.append(time.perf_counter() - start)
            if name == "verify_contents":
                assert out == [], out  # sound: nothing damaged
            rows[name] = {"seconds": statistics.median(times), "all_seconds": times}
    base = rows["read + zlib.crc32"]["seconds"]
    print(f"checkpoint verify, {size / 2**30:.2f} GiB in {args.tensors} tensors ({len(files)} files), page cache "
          f"warm, median of {args.repeats}")
    print(f"{'way':<20}{'seconds':>9}{'GB/s':>8}{'x read+crc':>12}")
    for name, row in rows.items():
        row["gb_per_s"] = size / 1e9 / row["seconds"]
        row["ratio_to_read_crc"] = row["seconds"] / base
        print(f"{name:<20}{row['seconds']:9.2f}{row['gb_per_s']:8.2f}{row['ratio_to_read_crc']:11.2f}x")
    result = {"bench": "checkpoint_verify", "date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()),
              "torch": torch.__version__, "bytes": size, "tensors": args.tensors, "repeats": args.repeats,
              "rows": rows}
    path = Path(args.out) / f"checkpoint_verify-{result['date']}.json"
    write_json_atomic(path, result)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
