"""The demo pipeline: base -> to-megatron -> data -> YaRN CPT (CP=2) -> SFT -> to-hf -> NIAH/perplexity.

Every step after the base runs the project's real command-line tools as subprocesses, exactly as a
user would type them (`tools/convert.py`, `tools/prepare_data.py`, `torchrun -m megatron_ext.train`,
`tools/niah.py`), with their output streamed so progress shows. Step times go to the report.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.runtime.job_env import free_port

ROOT = Path(__file__).resolve().parents[2]
ABLATION = "ablation: SFT only, base RoPE (no YaRN)"


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run (`quick()` gives the reduced version the test runs)."""

    base_steps: int = 1500
    base_batch: int = 16
    base_lr: float = 3e-3
    base_recall_weight: float = 10.0
    base_kv_every: int = 0
    base_length_power: float = 2.0
    cpt_steps: int = 60
    cpt_batch: int = 4
    cpt_docs: int = 400
    sft_steps: int = 400
    sft_chats: int = 600
    lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    depths: str = "0:100:10"
    samples: int = 2
    ppl_docs: int = 8
    seed: int = 0

    @classmethod
    def quick(cls) -> "DemoSettings":
        return cls(base_steps=4, base_batch=2, cpt_steps=2, cpt_batch=2, cpt_docs=40, sft_steps=1, sft_chats=16,
                   lengths=(256, 2048), depths="0,100", samples=1, ppl_docs=1)

    def base_key(self) -> dict:
        """What the cached base model depends on."""
        return {"base_steps": self.base_steps, "base_batch": self.base_batch, "base_lr": self.base_lr,
                "base_recall_weight": self.base_recall_weight, "base_kv_every": self.base_kv_every,
                "base_length_power": self.base_length_power,
                "seed": self.seed, "version": 1}


@dataclass
class StepLog:
    """Wall time of each pipeline step, in run order."""

    seconds: dict[str, float] = field(default_factory=dict)
    cached: set[str] = field(default_factory=set)

    def run(self, name: str, fn, *args, **kwargs):
        print(f"\n[demo] === {name} ===", flush=True)
        t0 = time.time()
        out = fn(*args, **kwargs)
        self.seconds[name] = round(time.time() - t0, 1)
        print(f"[demo] {name}: {self.seconds[name]:.1f}s", flush=True)
        return out


def _tool_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                TOKENIZERS_PARALLELISM="false")


def _show(line: str) -> None:
    if not line.startswith("warning:") and "Warning" not in line:
        print("    " + line, end="" if line.endswith("\n") else "\n", flush=True)


def _failed(cmd: list, returncode: int) -> RuntimeError:
    return RuntimeError(f"step failed (exit {returncode}, output above): {' '.join(str(c) for c in cmd)}")


def run_tool(cmd: list[str], log_file: Path | None = None) -> None:
    """Run a CLI with PYTHONPATH at the checkout, streaming its output (and copying it to `log_file`)."""
    print("[demo] $ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    with subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=_tool_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            _show(line)
        proc.wait()
    if log_file is not None:
        log_file.write_text("".join(lines))
    if proc.returncode != 0:
        raise _failed(cmd, proc.returncode)


def run_tools(cmds: list[list], workers: int | None = None) -> None:
    """Independent single-process CLIs, `workers` at a time (default: 2, or 1 on a one-core machine; each runs one
    thread): each one's command and output are printed when it and those before it have ended, in order. Raises
    for the first that failed, after all have run."""
    from concurrent.futures import ThreadPoolExecutor

    workers = workers or min(2, os.cpu_count() or 1)

    def run(cmd: list) -> subprocess.CompletedProcess:
        return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=_tool_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)

    failed = None
    with ThreadPoolExecutor(workers) as pool:
        for cmd, proc in zip(cmds, pool.map(run, cmds)):
            print("[demo] $ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
            for line in proc.stdout.splitlines(keepends=True):
                _show(line)
            if proc.returncode != 0 and failed is None:
                failed = _failed(cmd, proc.returncode)
    if failed is not None:
        raise failed


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", "--master_addr=127.0.0.1"]


def yarn_untrained(base_hf: Path, out: Path, recipe_path: Path) -> Path:
    """A copy of the base HF folder whose config carries the CPT recipe's YaRN RoPE (no training):
    the "base + YaRN" row of the paper's ablation. Weights are hard-linked, not copied."""
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.recipe import load_recipe

    recipe = load_recipe(recipe_path, ["model.preset=null", f"model.hf_config={base_hf}"], world_size=2)
    rope_cfg = hf_config_from_recipe(recipe)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base_hf.iterdir():
        if f.name != "config.json":
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    cfg = json.loads((base_hf / "config.json").read_text())
    for k in ("rope_scaling", "rope_parameters", "rope_theta"):
        cfg.pop(k, None)
    for k in ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings"):
        if k in rope_cfg:
            cfg[k] = rope_cfg[k]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def rope_overrides_from_hf(hf_dir: Path) -> list[str]:
    """Recipe overrides (`rope.FIELD=VALUE`) that set every rope field to the HF model's own RoPE
    (fields it does not use: null), e.g. to run a recipe whose rope is YaRN with the base's llama3."""
    from dataclasses import fields

    from megatron_ext.recipe import RopeConfig
    from megatron_ext.recipe_sources import rope_from_hf_config

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = rope_from_hf_config(cfg)
    rope.setdefault("rope_theta", 10000.0)
    rope.setdefault("rope_type", "default")
    out = []
    for f in fields(RopeConfig):
        if f.name == "preset":
            continue
        value = rope.get(f.name)
        if value is not None:
            out.append(f"rope.{f.name}={json.dumps(value)}")
        elif f.default is None:  # a field of another rope type (e.g. yarn's beta_fast): unset it
            out.append(f"rope.{f.name}=null")
    return out
