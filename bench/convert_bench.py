"""Convert a Llama-3.1-shaped random checkpoint both ways; compare with copying the same bytes.

    python bench/convert_bench.py [--shape 1b|3b|8b] [--work DIR] [--keep]

Writes random bf16 HF safetensors of the chosen shape, then times `cp -r` of that folder (the
baseline: reading and writing the same bytes), `tools/convert.py to-megatron` and `to-hf` (each in
its own process, which reports its peak RSS), and checks that the round trip is bit-exact.
Prints one JSON object and stores it under bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_json_atomic  # noqa: E402
from megatron_ext.presets import LLAMA31_8B  # noqa: E402

SHAPES = {
    # Llama-3.2-1B/3B layer shapes with Llama-3.1's vocab, untied lm_head (as in Llama-3.1-8B)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
    "8b": {},
}


def write_random_hf(out: Path, cfg: dict, shard_bytes: int = 2 * 2**30) -> int:
    """Random bf16 weights of `cfg` as sharded safetensors + index + config; returns bytes written."""
    from megatron_ext.convert.hf_io import StreamingSafetensorsWriter
    from megatron_ext.convert.mapping import hf_shapes
    from megatron_ext.hf_config import normalize_hf_config

    out.mkdir(parents=True)
    shapes = hf_shapes(normalize_hf_config(cfg))
    writer = StreamingSafetensorsWriter(out, [(n, s, torch.bfloat16) for n, s in shapes.items()], shard_bytes)
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.close()
    (out / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16"), indent=2))
    return writer.total


def timed(cmd: list[str]) -> tuple[float, dict]:
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.time() - start
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return wall, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--work", type=Path, default=None,
                    help="work folder, emptied first (default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()

    cfg = dict(LLAMA31_8B, **SHAPES[args.shape])
    if args.work is None:  # not a fixed name under a shared /tmp, which another user could make first
        args.work = Path(tempfile.mkdtemp(prefix="convert_bench-"))
    else:
        shutil.rmtree(args.work, ignore_errors=True)
    hf, copy, mc, back = (args.work / n for n in ("hf", "hf_copy", "megatron", "hf_back"))
    t0 = time.time()
    nbytes = write_random_hf(hf, cfg)
    gen_s = time.time() - t0
    subprocess.run(["sync"])
    t0 = time.time()
    subprocess.run(["cp", "-r", str(hf), str(copy)], check=True)
    subprocess.run(["sync"])
    cp_s = time.time() - t0
    shutil.rmtree(copy)
    tool = [sys.executable, str(ROOT / "tools/convert.py")]
    to_mc_s, r1 = timed(tool + ["to-megatron", "--hf", str(hf), "--out", str(mc), "--no-progress"])
    to_hf_s, r2 = timed(tool + ["to-hf", "--megatron", str(mc), "--out", str(back), "--no-progress"])

    from safetensors import safe_open

    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    index_back = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    exact = sorted(index) == sorted(index_back)
    for name in index:  # one tensor at a time
        with safe_open(str(hf / index[name]), "pt") as a, safe_open(str(back / index_back[name]), "pt") as b:
            exact = exact and torch.equal(a.get_tensor(name), b.get_tensor(name))
    params = nbytes // 2
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": args.shape, "params": params, "model_bytes": nbytes, "cpus": os.cpu_count(),
        "generate_s": round(gen_s, 1), "cp_s": round(cp_s, 1),
        "to_megatron_s": round(to_mc_s, 1), "to_hf_s": round(to_hf_s, 1),
        "to_megatron_over_cp": round(to_mc_s / cp_s, 2), "to_hf_over_cp": round(to_hf_s / cp_s, 2),
        "to_megatron_peak_rss_gib": r1["peak_rss_gib"], "to_hf_peak_rss_gib": r2["peak_rss_gib"],
        "to_megatron_rss_over_model": round(r1["peak_rss_gib"] * 2**30 / nbytes, 2),
        "to_hf_rss_over_model": round(r2["peak_rss_gib"] * 2**30 / nbytes, 2),
        "round_trip_bit_exact": exact,
    }
    print(json.dumps(result))
    write_json_atomic(ROOT / "bench/results" / f"convert_{args.shape}_{result['date'][:10]}.json", result)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
