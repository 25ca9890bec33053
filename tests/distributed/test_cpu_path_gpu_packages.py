"""The CPU path on a node where Transformer Engine and Apex import (a GPU cluster's image): Megatron-Core picks
their CUDA kernels (fused Adam, multi-tensor norms, the final norm) when it is imported, whatever the device, so
the CPU path must keep them out (cpu_backend.py, P0). Stand-ins for both packages raise when imported: a CPU
training run, a conversion with --verify and the Megatron evaluation engine must never import them."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

RAISES = 'raise RuntimeError("{name} imported on the CPU path")\n'


@pytest.fixture(scope="module")
def gpu_packages(tmp_path_factory):
    """A folder that makes `import transformer_engine`, `import apex` and their extensions fail loudly (not with
    ImportError, which Megatron takes for 'not installed')."""
    folder = tmp_path_factory.mktemp("gpu_packages")
    for name in ("transformer_engine", "apex"):
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(RAISES.format(name=name))
    # and the compiled extensions that come with them, which Megatron-Core imports on their own (amp_C before
    # apex in its optimizer and clip_grads, fused_weight_gradient_mlp_cuda in its linear layers)
    for name in ("transformer_engine_torch", "amp_C", "fused_weight_gradient_mlp_cuda"):
        (folder / f"{name}.py").write_text(RAISES.format(name=name))
    return folder


def run(gpu_packages, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=f"{gpu_packages}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def test_the_stand_ins_are_seen(gpu_packages):
    """The control: Megatron-Core imported as the GPU path imports it meets the stand-in."""
    proc = run(gpu_packages, "-c", "import megatron.core.parallel_state")
    assert proc.returncode != 0 and "transformer_engine imported on the CPU path" in proc.stderr


def test_cpu_training_and_conversion_never_import_them(gpu_packages, tmp_path, token_data):
    from tests.unit.test_evaluate import save_tiny

    proc = run(gpu_packages, "-m", "megatron_ext.train", "--recipe", "recipes/tiny/cpt.yaml", f"data.prefix={token_data}",
               "parallel.context=1", "train.steps=2", f"checkpoint.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    save_tiny(tmp_path / "hf")
    proc = run(gpu_packages, "tools/convert.py", "to-megatron", "--hf", str(tmp_path / "hf"), "--out",
               str(tmp_path / "mc"), "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run(gpu_packages, "tools/niah.py", "generate", "--megatron", str(tmp_path / "mc"), "--engine", "megatron",
               "--device", "cpu", "--question", "Who?", "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
