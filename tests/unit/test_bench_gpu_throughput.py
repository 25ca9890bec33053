"""bench/gpu_throughput.py: the CPU dry run (real Megatron-Core and transformers at toy sizes), the offline
wheel install, and the out-of-memory / time-budget handling that only a GPU would trigger for real."""

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from bench import gpu_throughput as gt
from bench.measure import Clock
from bench.stacks import Settings
from megatron_ext.cost_model import GPUS, shape_from_hf_config, train_flops_per_token
from megatron_ext.presets import TINY

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_throughput.py"), "--cpu-dry-run", "--out", str(out),
                           "--label", "dry"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout, json.loads((out / "gpu_throughput.json").read_text()), out


def test_dry_run_table_and_json(dry_run):
    stdout, doc, out = dry_run
    assert doc["schema"] == gt.SCHEMA and doc["settings"]["device"] == "cpu" and doc["label"] == "dry"
    assert doc["peak_tflops"] == 989.4 and doc["matmul"]["tflops"] > 0
    assert doc["gpu_spec"]["name"] == "h200-141gb" and "planned as on this GPU" in stdout
    rows = [r for r in doc["results"] if ":" not in r["recompute"]]
    assert sorted((r["stack"], r["length"]) for r in rows) == [(s, L) for s in ("ours", "peer") for L in (64, 128, 256)]
    # then ours again where full recompute ran, recomputing only the first layer (the planner's fewest that fit)
    partial = [r for r in doc["results"] if ":" in r["recompute"]]
    assert [(r["stack"], r["length"], r["recompute"], r["status"]) for r in partial] == [
        ("ours", 128, "full:1", "ok"), ("ours", 256, "full:1", "ok")]
    assert all(r["plan"]["activations_gib"] > 0 for r in partial)
    shape = shape_from_hf_config(TINY)
    for r in rows + partial:
        assert r["status"] == "ok", r
        assert r["recompute"] in (["none"] if r["length"] < 128 else ["full", "full:1"])
        assert len(r["step_s_all"]) == r["iters"] == 2 and r["step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["length"] / r["step_s"])
        assert r["flops_per_token"] == train_flops_per_token(shape, r["length"], causal=True)
        assert r["tflops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12)
        assert r["mfu_peak"] == pytest.approx(r["tflops"] / 989.4)
        assert r["mfu_matmul"] == pytest.approx(r["tflops"] / doc["matmul"]["tflops"])
        # a freshly initialised model on random tokens: loss about ln(vocab) = 6.24, for both stacks
        assert abs(r["loss_first"] - math.log(512)) < 0.3 and math.isfinite(r["loss_last"])
        assert r["peak_gib"] > 0
    by = {(r["stack"], r["length"]): r for r in rows}
    for L in (64, 128, 256):
        assert doc["ratios"][str(L)] == pytest.approx(by["ours", L]["tokens_per_s"] / by["peer", L]["tokens_per_s"])
    stacks = doc["stacks"]
    assert stacks["ours"]["none/2L"]["transformer_impl"] == "local"  # no TE: torch SDPA core attention
    assert stacks["peer"]["full/2L"]["gradient_checkpointing"] and not stacks["peer"]["none/2L"]["gradient_checkpointing"]
    assert stacks["peer"]["none/2L"]["attn_implementation"] == "sdpa"
    # the planner's memory for our stack rides along, to be compared with the measured peak on a GPU
    assert all(r["plan"]["total_gib"] > 0 for r in rows if r["stack"] == "ours")
    # one profiled step per stack at 128, both in one text file next to the JSON
    for name in ("ours", "peer"):
        prof = by[name, 128]["profile"]
        assert prof["section"] in (out / prof["file"]).read_text() and sum(prof["share"].values()) == pytest.approx(1.0)
    # the inclusive op times name the layers, whatever their rank among the ops; ours has the chunked loss head
    # (forward and backward) and full recompute; the peer's loss is plain cross entropy, not ours
    layers = by["ours", 128]["profile"]["layers_inclusive_us"]
    assert layers["_ChunkedLinearCrossEntropy"] > 0 and layers["_ChunkedLinearCrossEntropyBackward"] > 0, layers
    assert layers["CheckpointFunction"] > 0 and any("scaled_dot_product" in n for n in layers), layers
    assert not any("ChunkedLinearCrossEntropy" in n for n in by["peer", 128]["profile"]["layers_inclusive_us"])
    assert len(by["ours", 128]["profile"]["top_ops_inclusive_us"]) == 25
    # the printed table: header, rule, one line per row, ratios on the ours rows
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("length"))
    table = lines[head + 2: head + 8]
    assert [ln.split()[:4] for ln in table[:2]] == [["64", "2", "ours", "none"], ["64", "2", "peer", "none"]]
    assert [ln.split()[:4] for ln in lines[head + 4: head + 7]] == [
        ["128", "2", "ours", "full"], ["128", "2", "ours", "full:1"], ["128", "2", "peer", "full"]]
    assert f"{doc['ratios']['64']:.2f}x" in table[0]


def _wheel(folder: Path, name: str, body: str) -> Path:
    """A minimal pure-Python wheel of package `name` (made here: no index is reachable on the device either)."""
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": body, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def test_ensure_packages_installs_carried_wheels(tmp_path):
    name = "bench_probe_pkg"
    wheels, site = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    with pytest.raises(gt.BenchError, match="holds no .whl"):  # negative control: nothing carried
        gt.ensure_packages(wheels, site, module=name)
    # a wheel for another Python (a cp311 one left from a CPU check): pip would refuse the whole call
    (wheels / "other-1.0-cp27-cp27m-win32.whl").write_bytes(b"not a zip")
    with pytest.raises(gt.BenchError, match=r"holds no \.whl file this Python can install \(found "
                                            r"\['other-1\.0-cp27-cp27m-win32\.whl'\]\)"):
        gt.ensure_packages(wheels, site, module=name)
    _wheel(wheels, name, "VALUE = 42\n")
    try:
        assert gt.ensure_packages(wheels, site, module=name) == [f"{name}-1.0-py3-none-any.whl"]
        assert sys.modules[name].VALUE == 42 and sys.modules[name].__file__.startswith(str(site))
        assert gt.ensure_packages(wheels, site, module=name) == []  # already importable: nothing installed
    finally:
        sys.modules.pop(name, None)
        if str(site) in sys.path:
            sys.path.remove(str(site))


class _FaultyStack:
    """Stands in for a stack on a GPU: steps of `oom_from` tokens or more raise CUDA's out-of-memory error."""

    name = "ours"
    oom_from = 128
    info = {"fake": True}

    def __init__(self, s, recompute):
        self.layers = s.layers

    def batch(self, length, vocab, device, gen):
        return {"length": length}

    def step(self, batch):
        if batch["length"] >= self.oom_from and self.layers > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 62.63 GiB")
        return torch.tensor(2.0)

    @staticmethod
    def loss_value(out):
        return float(out)


def _run(tmp_path, budget_s):
    s = Settings(device="cpu", preset="tiny", layers=4, lengths=[64, 128, 256], recompute_from=10**6,
                 stacks=["ours"], warmup=1, iters=2, long_step_s=4.0, budget_s=budget_s, matmul_n=64,
                 profile_lengths=[], out=tmp_path)
    doc = {"model": {"vocab_size": 512, "num_hidden_layers": 4}, "matmul": {"tflops": 1.0}, "stacks": {},
           "results": []}
    return gt.Run(s, Clock(budget_s), doc, lambda layers, L: 1e6 * layers, GPUS["h200-141gb"]), doc


def test_out_of_memory_is_recorded_and_longer_lengths_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(gt.STACKS, "ours", _FaultyStack)
    run, doc = _run(tmp_path, budget_s=600)
    run.run_stack("ours", "none", [64, 128, 256])
    status = {r["length"]: (r["status"], r.get("reason", "")) for r in doc["results"]}
    assert status[64][0] == "ok"
    assert status[128][0] == "oom" and "out of memory" in status[128][1]
    assert status[256] == ("skipped", "out of memory at 128")
    saved = json.loads((tmp_path / "gpu_throughput.json").read_text())  # written after every row
    assert [r["status"] for r in saved["results"]] == ["ok", "oom", "skipped"]
    # the out-of-memory length and the one skipped after it again with 2 layers (a number at every length)
    run.run_fallback(2)
    extra = doc["results"][3:]
    assert [(r["length"], r["layers"], r["status"]) for r in extra] == [(128, 2, "ok"), (256, 2, "ok")]
    assert extra[0]["flops_per_token"] == 2e6 and run.s.layers == 4
    # auto (the default on a GPU): the layer count the planner gives each length
    run, doc = _run(tmp_path, budget_s=600)
    run.run_stack("ours", "none", [64, 128, 256])
    monkeypatch.setattr(gt, "auto_fallback_layers", lambda s, gpu, L, recompute: 3 if L == 128 else 2)
    run.run_fallback(None)
    assert [(r["length"], r["layers"], r["status"]) for r in doc["results"][3:]] == [(128, 3, "oom"), (256, 2, "ok")]


def test_the_gpu_found_decides_fallback_and_partial_recompute():
    """The planner fits rows in the GPU the run has (an H100's 80 GB, an H200's 141), not always an H200's: on an
    H100 a 128K row of the 4-layer model needs 1 layer and 64K no partial recompute fits; on an H200, 3 and 2."""
    from bench.gpu_plan import auto_fallback_layers, partial_layers, plan_row

    s = gt.settings_from_args(gt.build_parser().parse_args([]))
    h100, h200 = GPUS["h100-80gb"], GPUS["h200-141gb"]
    assert s.layers == 4 and h100.memory_gb == 80
    assert not plan_row(s, h100, 131072, "full").fits and plan_row(s, h200, 131072, "full").fits
    assert (auto_fallback_layers(s, h100, 131072, "full"), auto_fallback_layers(s, h200, 131072, "full")) == (1, 3)
    assert (partial_layers(s, h100, 65536), partial_layers(s, h200, 131072)) == (None, 2)


def test_gpu_flag_is_checked():
    with pytest.raises(gt.BenchError, match=r"--gpu 'a100': expected one of h100-80gb, h200-141gb"):
        gt.settings_from_args(gt.build_parser().parse_args(["--gpu", "a100"]))
    with pytest.raises(gt.BenchError, match=r"--fallback-layers 'two': expected auto or a number"):
        gt.settings_from_args(gt.build_parser().parse_args(["--fallback-layers", "two"]))
    assert gt.settings_from_args(gt.build_parser().parse_args(["--gpu", "H100"])).gpu == "h100-80gb"
    assert gt.settings_from_args(gt.build_parser().parse_args([])).fallback_layers is None  # auto on a GPU
    assert gt.settings_from_args(gt.build_parser().parse_args(["--cpu-dry-run"])).fallback_layers == 0


def test_time_budget_skips_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(gt.STACKS, "ours", _FaultyStack)
    run, doc = _run(tmp_path, budget_s=10)  # under the 30 s needed to build a stack
    run.run_stack("ours", "none", [64, 128])
    assert [(r["status"], r["reason"]) for r in doc["results"]] == [("skipped", "time budget (before build)")] * 2
    run, doc = _run(tmp_path, budget_s=600)
    doc["matmul"]["tflops"] = 1e-9  # predicted steps of hours: every length is skipped, not run
    run.run_stack("ours", "none", [64])
    assert doc["results"][0]["status"] == "skipped" and doc["results"][0]["reason"].startswith("time budget: needs")


def test_user_error_is_one_line(capsys):
    assert gt.main(["--cpu-dry-run", "--lengths", "8x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --lengths") and "'8x'" in err[0]


def test_short_steps_get_more_timed_iterations(tmp_path, monkeypatch):
    monkeypatch.setitem(gt.STACKS, "ours", _FaultyStack)
    run, doc = _run(tmp_path, budget_s=600)
    run.run_stack("ours", "none", [64])  # predicted ~1 ms a step (FLOPs / a quarter of the matmul rate)
    assert doc["results"][0]["iters"] == 2  # min_timed_s off: the asked 2
    run, doc = _run(tmp_path, budget_s=600)
    run.s.min_timed_s = 0.5
    run.run_stack("ours", "none", [64])
    assert doc["results"][0]["iters_asked"] == doc["results"][0]["iters"] == 20  # capped at 20


def test_sdpa_kernel_flag_reaches_our_recipe():
    """--sdpa-kernel (e.g. cudnn, once bench/sdpa_kernels_bench.py has measured it fastest) times our stack with
    that kernel forced; the default is SDPA's own choice, what a recipe gets."""
    from bench.stacks import make_recipe

    args = gt.build_parser().parse_args(["--cpu-dry-run", "--sdpa-kernel", "math"])
    settings = gt.settings_from_args(args)
    assert make_recipe(settings, "none").runtime.sdpa_kernel == "math"
    default = gt.settings_from_args(gt.build_parser().parse_args(["--cpu-dry-run"]))
    assert make_recipe(default, "none").runtime.sdpa_kernel == "auto"
