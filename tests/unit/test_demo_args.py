"""The demo's paths: a relative --out works from any directory (its tools run with the checkout as their cwd)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture
def demo_main(monkeypatch):
    """megatron_ext.demo.__main__, imported without its hiding of the GPUs outliving the test (it sets
    CUDA_VISIBLE_DEVICES at import; monkeypatch puts the variable back as it was)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    import megatron_ext.demo.__main__ as demo_main

    return demo_main


def test_a_relative_out_is_made_absolute_at_parse_time(demo_main, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = {}
    monkeypatch.setattr(demo_main, "run_demo", lambda out, settings, fresh=False: got.setdefault("out", out))
    assert demo_main.main(["--quick", "--out", "demo_rel"]) == 0
    assert got["out"] == Path.cwd() / "demo_rel" and got["out"].is_absolute()
    assert demo_main.parse_args([]).out.is_absolute()  # the default, in the checkout


def test_every_command_names_the_out_folder_by_its_absolute_path(demo_main, tmp_path, monkeypatch):
    """The pipeline, its tools replaced by recorders, called with a relative folder from another directory: each
    command that names the folder names it absolutely (the bug: `--hf demo_rel/base_hf: directory does not
    exist`, read from the checkout)."""
    from megatron_ext.demo import report
    from megatron_ext.demo.pipeline import DemoSettings

    monkeypatch.chdir(tmp_path)
    settings = DemoSettings.quick()
    (tmp_path / "demo_rel" / "base_hf").mkdir(parents=True)  # a cached base model: no training here
    (tmp_path / "demo_rel" / "base_hf" / "demo_base.json").write_text(json.dumps(settings.base_key()))
    (tmp_path / "demo_rel" / "tokenizer").mkdir()
    (tmp_path / "demo_rel" / "tokenizer" / "tokenizer.json").write_text("{}")
    commands = []

    def write_report(out, *args, **kwargs):
        (out / "REPORT.md").write_text("report")
        return out / "REPORT.md"

    monkeypatch.setattr(demo_main, "run_tool", lambda cmd, log_file=None: commands.append(cmd))
    monkeypatch.setattr(demo_main, "run_tools", lambda cmds, workers=None: commands.extend(cmds))
    monkeypatch.setattr(demo_main, "yarn_untrained", lambda base_hf, out, recipe: out)
    monkeypatch.setattr(demo_main, "rope_overrides_from_hf", lambda hf_dir: [])
    monkeypatch.setattr(report, "write_report", write_report)
    demo_main.run_demo(Path("demo_rel"), settings)

    absolute = str(Path.cwd() / "demo_rel")
    mentions = [str(arg) for cmd in commands for arg in cmd if "demo_rel" in str(arg)]
    assert len(commands) >= 10 and len(mentions) >= 30
    assert [m for m in mentions if absolute not in m] == []
