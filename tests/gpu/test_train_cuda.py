"""The training loop (`python -m megatron_ext.train`) on one CUDA GPU, against the same run on the CPU.

The CPU tests run the loop on gloo only; NCCL takes CUDA tensors only and the model lives on the GPU, so the
batches and every tensor of a collective must be there too (they were not until this test was written: the
loop had never run on a GPU). Oracle: the same recipe with runtime.device=cpu, fp32, from the same weights (a
converted HF model: each device draws its own random initial weights, the CPU from torch's CPU generator with
`use_cpu_initialization`, the GPU from the CUDA one; the first H200 run, without it, differed by 0.2% at step 1
and 2.7% at step 4): losses, gradient norms and validation losses step by step; then a resume on the GPU (saving
in the background), an SFT stage on the GPU from the CPU run's checkpoint, and a diverging run stopping with
EXIT_DIVERGED (its flag goes through an NCCL all-reduce). Also the CPU path (conversion, runtime.device=cpu) on
this machine with its GPU visible.
"""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_ext.checkpoint_index import check_complete
from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMMON = ["train.seq_length=256", "train.global_batch_size=2", "train.lr=1e-2", "parallel.context=1",
          "train.precision=fp32", "data.split=80,20,0", "train.eval_interval=2", "runtime.attention=sdpa"]


def train(stage: str, out, data, device: str, *overrides, expect: int = 0, hide_gpus: bool = True) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="4", PYTHONWARNINGS="ignore")
    if device == "cpu" and hide_gpus:  # the oracle runs as a CPU machine would run it
        env["CUDA_VISIBLE_DEVICES"] = ""
    recipe = ROOT / f"recipes/tiny/{stage}.yaml"
    cmd = [sys.executable, "-m", "megatron_ext.train", "--recipe", str(recipe), f"checkpoint.dir={out}",
           f"data.prefix={data}", f"runtime.device={device}", *COMMON, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = out / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def columns(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics if key in m]


@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> str:
    """The override that starts both devices' runs from one converted model's weights."""
    return f"checkpoint.init_from={tiny_checkpoint / 'mc'}"


def test_training_on_cuda_equals_cpu(tmp_path, token_data, sft_data, base):
    cpu = train("cpt", tmp_path / "cpu", token_data, "cpu", "train.steps=4", base)
    gpu = train("cpt", tmp_path / "gpu", token_data, "cuda", "train.steps=4", base)
    assert [m["step"] for m in gpu] == [1, 2, 3, 4] and len(columns(gpu, "val_loss")) == 2
    for key in ("loss", "grad_norm", "val_loss"):
        np.testing.assert_allclose(columns(gpu, key), columns(cpu, key), rtol=1e-3, err_msg=key)
    assert gpu[-1]["memory_gib"] > 0 and (tmp_path / "gpu/iter_0000004").is_dir()

    # the resumed run saves in the background: the state staged from the GPU, the writer forked after CUDA init
    resumed = train("cpt", tmp_path / "gpu", token_data, "cuda", "train.steps=5", "checkpoint.async_save=true")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5] and np.isfinite(resumed[-1]["loss"])
    check_complete(tmp_path / "gpu/iter_0000005")
    assert (tmp_path / "gpu/latest_checkpointed_iteration.txt").read_text().strip() == "5"

    sft_cpu = train("sft", tmp_path / "sft_cpu", sft_data, "cpu", "train.steps=2",
                    f"checkpoint.init_from={tmp_path / 'cpu'}")
    sft_gpu = train("sft", tmp_path / "sft_gpu", sft_data, "cuda", "train.steps=2",
                    f"checkpoint.init_from={tmp_path / 'cpu'}")
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(columns(sft_gpu, key), columns(sft_cpu, key), rtol=1e-3, err_msg=key)


def test_plain_optimizer_on_cuda_equals_cpu(tmp_path, token_data, base):
    """train.distributed_optimizer=false on the GPU. Only the distributed optimizer's DDP buffers move parameters,
    so the model itself must be on the GPU: the local spec's norms (torch RMSNorm) are built on the host."""
    plain = ["train.steps=2", "train.eval_interval=0", "train.distributed_optimizer=false", base]
    cpu = train("cpt", tmp_path / "cpu", token_data, "cpu", *plain)
    gpu = train("cpt", tmp_path / "gpu", token_data, "cuda", *plain)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(columns(gpu, key), columns(cpu, key), rtol=1e-3, err_msg=key)


def test_divergence_on_cuda_stops_with_exit_diverged(tmp_path, token_data):
    train("cpt", tmp_path, token_data, "cuda", "train.steps=4", "train.lr=1e30", "train.eval_interval=0",
          "checkpoint.interval=1", expect=4)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_cpu_path_on_a_gpu_machine(tmp_path, token_data):
    """runtime.device=cpu and tools/convert.py (CPU only) on a machine with a GPU, the GPU left visible: the CPU
    backend hides it from the process (it refused to run here before: a cluster node could not convert)."""
    from tests.unit.test_evaluate import save_tiny

    save_tiny(tmp_path / "hf")
    proc = subprocess.run([sys.executable, str(ROOT / "tools/convert.py"), "to-megatron", "--hf", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "mc")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = train("cpt", tmp_path / "run", token_data, "cpu", "train.steps=2", hide_gpus=False)
    assert [m["step"] for m in metrics] == [1, 2] and np.isfinite(metrics[-1]["loss"])


def test_profiled_overlapped_bf16_steps_on_cuda(tmp_path, token_data):
    """profile.steps on a GPU: the trace holds CUDA kernels inside the traced steps and the table sorts by device
    time; with the DP overlap on (one GPU: buckets of one rank) the losses stay the plain run's; bf16 steps on a
    GPU whose peak cost_model.GPUS knows (the H200 here) carry mfu = TFLOP/s / peak."""
    from megatron_ext.cost_model import gpu_from_device_name
    from tests.unit.test_train_profile import check_trace

    bf16 = ["train.steps=3", "train.eval_interval=0", "train.precision=bf16"]
    plain = train("cpt", tmp_path / "plain", token_data, "cuda", *bf16)
    run = train("cpt", tmp_path / "run", token_data, "cuda", *bf16, "profile.steps=[2,3]",
                "train.overlap_grad_reduce=true", "train.overlap_param_gather=true", "train.ddp_bucket_size=20000")
    np.testing.assert_allclose(columns(run, "loss"), columns(plain, "loss"), rtol=1e-3)
    check_trace(tmp_path / "run/profile", 0, 2, 3, 3)
    with gzip.open(tmp_path / "run/profile/rank0.steps2-3.pt.trace.json.gz", "rt") as f:
        assert [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    assert "self_device_time_total" in (tmp_path / "run/profile/rank0.steps2-3.txt").read_text()
    peak = gpu_from_device_name(torch.cuda.get_device_name())
    if peak is not None:
        assert run[-1]["mfu"] == pytest.approx(run[-1]["tflops_per_device"] / peak.bf16_tflops, rel=1e-9)
        assert 0 < run[-1]["mfu"] < 1


def test_out_of_memory_on_cuda_is_one_line(tmp_path, token_data):
    """A 4.4 TB embedding table on the GPU (or on the host first, whichever refuses): one error line, exit 1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(ROOT / "recipes/tiny/cpt.yaml"),
                           f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "runtime.device=cuda",
                           *COMMON, "train.steps=1", "model.vocab_size=17179869184"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "out of memory (" in errors[0] and "tools/plan.py" in errors[0], errors
