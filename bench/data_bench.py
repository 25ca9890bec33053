"""Throughput and memory of `prepare_data.py cpt` against the bare tokenizer on the same texts.

    python bench/data_bench.py --tokenizer TOK_DIR [--mb 50] [--scale 4] [--workers 2]

Writes a synthetic corpus of `--mb` MB (and `--scale` times that), then measures
- bare: `tokenizer.encode_batch` (the Rust fast path, same batch size and thread count) on the
  same texts, already in memory (reading and JSON parsing excluded: the baseline is pure tokenization);
- pipeline: the whole CLI in a fresh process (read, parse, tokenize, write .bin/.idx/.json),
  tokens/s as the pipeline reports it (streaming phase: first read to manifest; the one-off
  tokenizer load is reported as setup and in wall_s_with_startup), peak RSS from wait4().
Both wall-clock and CPU-time rates are reported (tokens per second of all threads' CPU time is
robust when other jobs share the cores). Goal (issue 5): pipeline >= 0.8x bare; peak RSS flat when the input grows `--scale`x.
Prints one JSON line and stores it under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _write_corpus(path: Path, mb: float) -> int:
    from megatron_ext.data.toy import synthetic_corpus

    target, n = int(mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in synthetic_corpus(10 ** 9, seed=len(str(path))):
            line = json.dumps(doc) + "\n"
            f.write(line)
            n += len(line)
            if n >= target:
                break
    return n


def _bare(path: Path, tok_dir: str, batch_docs: int) -> dict:
    from megatron_ext.data.common import load_tokenizer

    backend = load_tokenizer(tok_dir).backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    texts = [json.loads(line)["text"] for line in open(path, encoding="utf-8")]
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(texts), batch_docs):
        n += sum(len(e.ids) for e in encode(texts[i:i + batch_docs], add_special_tokens=False))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt), "cpu_s": round(cpu, 2),
            "tokens_per_cpu_s": round(n / cpu)}


def _pipeline(path: Path, tok_dir: str, out: Path, workers: int) -> dict:
    cmd = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), "cpt", "--input", str(path), "--tokenizer",
           tok_dir, "--output", str(out), "--workers", str(workers), "--force"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        sys.exit(f"error: pipeline failed:\n{err[-2000:]}")
    m = re.search(r"([\d,]+) tokens in ([\d.]+)s \(([\d,]+) tokens/s.*setup ([\d.]+)s, cpu ([\d.]+)s", err)
    return {"setup_s": float(m.group(4)), "cpu_s": float(m.group(5)),
            "tokens_per_cpu_s": round(int(m.group(1).replace(",", "")) / max(float(m.group(5)), 1e-9)), "tokens": int(m.group(1).replace(",", "")), "seconds": float(m.group(2)),
            "tokens_per_s": int(m.group(3).replace(",", "")), "wall_s_with_startup": round(wall, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--batch-docs", type=int, default=1024, help="must match prepare_cpt's default batch")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # same threads for the bare baseline
    res: dict = {"tokenizer": args.tokenizer, "workers": args.workers, "cpus": os.cpu_count(), "runs": []}
    with tempfile.TemporaryDirectory() as d:
        for mb in (args.mb, args.mb * args.scale):
            path = Path(d) / f"corpus_{int(mb)}mb.jsonl"
            size = _write_corpus(path, mb)
            # best of `repeat` interleaved runs: the machine is shared, so single timings are noisy
            pipes, bares = [], []
            for _ in range(args.repeat if mb == args.mb else 1):  # the scaled run is for RSS
                pipes.append(_pipeline(path, args.tokenizer, Path(d) / "out", args.workers))
                if mb == args.mb:
                    bares.append(_bare(path, args.tokenizer, args.batch_docs))
            pipe = max(pipes, key=lambda r: r["tokens_per_s"])
            pipe["peak_rss_mb"] = max(r["peak_rss_mb"] for r in pipes)
            bare = max(bares, key=lambda r: r["tokens_per_s"]) if bares else None
            run = {"input_mb": round(size / 1e6, 1), "pipeline": pipe}
            if bare:
                run["bare"] = bare
                run["pipeline_vs_bare"] = round(pipe["tokens_per_s"] / bare["tokens_per_s"], 3)
                # CPU-time efficiency: what the wall-clock ratio would be on an idle machine
                run["pipeline_vs_bare_cpu"] = round(pipe["tokens_per_cpu_s"] / bare["tokens_per_cpu_s"], 3)
                assert bare["tokens"] + 0 <= pipe["tokens"], "pipeline adds separators, never drops tokens"
            res["runs"].append(run)
            print(json.dumps(run), flush=True)
    r0, r1 = res["runs"]
    res["rss_growth"] = round(r1["pipeline"]["peak_rss_mb"] / r0["pipeline"]["peak_rss_mb"], 3)
    out = ROOT / "bench" / "results" / f"data_bench-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    from bench.report import write_json_atomic

    write_json_atomic(out, res)
    print(json.dumps({"pipeline_vs_bare": r0["pipeline_vs_bare"], "pipeline_vs_bare_cpu": r0["pipeline_vs_bare_cpu"],
                      "rss_growth": res["rss_growth"],
                      "result": str(out.relative_to(ROOT))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
