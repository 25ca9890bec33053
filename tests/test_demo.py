"""`make demo` end to end at reduced size: the same code path (`python -m megatron_ext.demo --quick`), fewer steps.

Checks that every step ran through the real tools and that the report holds the table, heatmaps,
perplexity plot and step times; the accuracy goal itself is for the full-size run (too few steps here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_ext.demo.pipeline import ABLATION

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _run(out: Path, *extra: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("FRESH", None)
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.demo", "--quick", "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_demo_quick_pipeline(tmp_path):
    out = tmp_path / "demo_out"
    log = _run(out)
    # Every step ran through its real CLI.
    for cmd in ("tools/convert.py to-megatron", "tools/prepare_data.py cpt", "--separator '<s>'",
                "tools/prepare_data.py sft", "-m megatron_ext.train --recipe recipes/demo/cpt.yaml",
                "recipes/demo/sft.yaml", "tools/convert.py to-hf", "tools/niah.py --model", "tools/niah.py ppl",
                "--engine megatron --cp 2"):
        assert cmd in log, f"step `{cmd}` did not run"
    assert "CP2" in (out / "cpt.log").read_text()  # context parallelism really used
    # The CPT checkpoint's exported config carries the recipe's YaRN RoPE at 8x the base context.
    cfg = json.loads((out / "cpt_hf" / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    assert rope["rope_type"] == "yarn" and rope["factor"] == 8.0 and rope["beta_fast"] == 4.0
    assert cfg["max_position_embeddings"] == 2048
    base_cfg = json.loads((out / "base_hf" / "config.json").read_text())
    assert (base_cfg.get("rope_parameters") or base_cfg.get("rope_scaling"))["rope_type"] == "llama3"

    report = (out / "REPORT.md").read_text()
    results = json.loads((out / "results.json").read_text())
    assert results["lengths"] == [256, 2048]
    for label in ("base", "base + YaRN, no training", "after YaRN CPT", "after CPT + SFT", ABLATION):
        assert f"| {label} |" in report
        assert all(v is None or 0.0 <= v <= 1.0 for v in results["niah"][label]["by_length"])
    for png in [*out.glob("eval/niah*/heatmap.png"), out / "perplexity_by_position.png"]:
        assert png.read_bytes()[:8] == PNG
    assert len(list(out.glob("eval/niah*/heatmap.png"))) == 5
    assert set(results["mean_loss"]) == {"base", "after YaRN CPT", "after CPT + SFT"}  # loss-by-position curves
    engine = results["megatron_engine"]  # the final grid on the Megatron checkpoint, cell by cell against transformers'
    assert engine["same_cells"] == engine["cells"], engine
    # with the KV cache: one pass over each prompt (or over its tokens after a prefix shared with the one before),
    # further tokens as decode steps
    assert engine["cells"] == 4 and engine["forward_passes"] + engine["extension_passes"] == 4
    assert engine["decode_steps"] >= 0
    assert len(engine["by_length"]) == 2
    assert "## The final model on the Megatron engine" in report
    # The ablation really ran with the base's llama3 RoPE, not the recipe's YaRN.
    abl = json.loads((out / "sft_no_yarn_hf" / "config.json").read_text())
    assert (abl.get("rope_parameters") or abl.get("rope_scaling"))["rope_type"] == "llama3"
    for step in ("to-megatron", "data", "cpt", "sft", "sft ablation", "to-hf", "evaluate"):
        assert f"| {step} |" in report


def _readme_block(title: str) -> list[str]:
    """The shell commands of the first ```bash block after README heading `title` (continuations joined, comments
    dropped)."""
    text = (ROOT / "README.md").read_text().split(f"## {title}", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [line.split("  #", 1)[0].strip() for line in joined.splitlines() if line.strip()]


def test_readme_offline_chain_runs_as_written(tmp_path):
    """README's "The whole chain by hand" block, command by command as written (the folder it runs in holds the
    repository's tools/ and recipes/, as the repository root does): data, CPT, SFT, export with --verify, NIAH."""
    commands = _readme_block("The whole chain by hand, offline, at toy scale")
    assert len(commands) == 7 and commands[0].startswith("python tools/prepare_data.py toy")
    for name in ("tools", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    venv_bin = str(Path(sys.executable).parent)  # `python` and `torchrun` of the environment running the tests
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "runs/tiny/sft/iter_0000004").is_dir()
    assert json.loads((tmp_path / "runs/tiny/hf/generation_config.json").read_text())["eos_token_id"] == 4
    niah = json.loads((tmp_path / "runs/tiny/niah/results.json").read_text())
    assert niah["lengths"] == [256, 1024] and len(niah["cells"]) == 22
