"""The demo's REPORT.md: every sentence that states a result follows the numbers in its own table."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ext.demo.pipeline import ABLATION, DemoSettings, StepLog
from megatron_ext.demo.report import Scored, _ablation_sentence, write_report

LABELS = ("base", "base + YaRN, no training", "after YaRN CPT", "after CPT + SFT", ABLATION)
SFT_DOES = "with the CPT's YaRN RoPE, does"
SFT_NOT_YARN = "the SFT, not the YaRN extension, brings retrieval"


def model_folders(out: Path, labels: tuple[str, ...]) -> dict[str, Path]:
    """Each model's folder under demo_out, by label, as the pipeline names them; only the base's config.json is
    written (the report reads the model's shape from it)."""
    models = {label: out / f"model{i}" for i, label in enumerate(labels)}
    models["base"].mkdir(parents=True)
    (models["base"] / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 3, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}))
    return models


def _report(tmp_path: Path, settings: DemoSettings, hits: dict[str, list[int]]) -> str:
    """REPORT.md for a demo whose NIAH grids found `hits[label][j]` needles at length j (the first ones of the
    grid's cells), from a folder laid out as the pipeline leaves it."""
    depths = [0.0, 100.0] if settings.depths == "0,100" else [float(d) for d in range(0, 101, 10)]  # quick, full
    lengths, samples = list(settings.lengths), settings.samples
    out = tmp_path / "demo_out"
    models = model_folders(out, LABELS)
    for i, label in enumerate(LABELS):
        cells = [{"length": n, "depth": d, "sample": s, "score": float(k < hits[label][j])}
                 for j, n in enumerate(lengths)
                 for k, (d, s) in enumerate((d, s) for d in depths for s in range(samples))]
        scores = [[sum(c["score"] for c in cells if c["length"] == n and c["depth"] == d) / samples
                   for n in lengths] for d in depths]
        res = {"lengths": lengths, "depths": depths, "scores": scores, "cells": cells, "settings": {},
               "accuracy": sum(c["score"] for c in cells) / len(cells)}
        (out / "eval" / f"niah{i}").mkdir(parents=True)
        (out / "eval" / f"niah{i}" / "results.json").write_text(json.dumps(res))
    write_report(out, models, StepLog(seconds={"cpt": 1.0}), settings, total_s=1.0)
    return (out / "REPORT.md").read_text()


def test_the_full_demos_numbers(tmp_path):
    """The README's run (22 needles per length at 11 places): base 95/77/27/0%, CPT 36/41/32/18%, final
    100/100/100/82%, ablation the same. The CPT's 18% at 2,048 is not clearly above the base's 0% at 11 places (it
    would be at 22 independent needles); the SFT rebuilds retrieval there; the ablation is level with the final
    model, so the SFT, not YaRN, brings it."""
    report = _report(tmp_path, DemoSettings(), {
        "base": [21, 17, 6, 0], "base + YaRN, no training": [13, 11, 8, 3], "after YaRN CPT": [8, 9, 7, 4],
        "after CPT + SFT": [22, 22, 22, 18], ABLATION: [22, 22, 22, 18]})
    assert "| after CPT + SFT | 100% | 100% | 100% | 82% |" in report
    assert "it does not by itself rebuild retrieval beyond the base context (18% at 2,048 tokens" in report
    assert f"{SFT_DOES}: 82% at 2,048 tokens." in report
    assert "level with the final model (82% against 82%, 22 needles at 11 places each" in report
    assert SFT_NOT_YARN in report
    assert "too small or too short" not in report


def test_all_zero_numbers_claim_nothing(tmp_path):
    """The quick demo (2 needles per length) where no model finds a needle: no sentence says the SFT rebuilds
    retrieval or that the ablation is level with the final model; the report says the run cannot tell."""
    report = _report(tmp_path, DemoSettings.quick(), {label: [0, 0] for label in LABELS})
    assert "| after CPT + SFT | 0% | 0% | 0% |" in report
    assert SFT_DOES not in report and SFT_NOT_YARN not in report and "level with" not in report
    assert "not clearly above the CPT model (2 needles each): the run is too small or too short" in report
    assert ("it scores 0% and the final model 0% (2 needles each), neither clearly above the base's 0%: the run "
            "is too small or too short to compare them.") in report


def test_the_ablation_sentence_weighs_the_difference_against_the_needles():
    full = Scored(22, 11)  # the full demo's grid at one length: 2 needles at each of 11 depths
    # YaRN clearly ahead: what it adds
    assert _ablation_sentence(0.86, 0.27, 0.0, 2048, full).startswith("at 2,048 it scores 59 points below the final")
    # one needle of two apart, the quick demo's grid: not a result either way
    short = _ablation_sentence(0.5, 0.0, 0.0, 2048, Scored(2, 2))
    assert "too small or too short" in short and "points below" not in short
    # the ablation clearly ahead of the final model and of the base
    ahead = _ablation_sentence(0.27, 0.86, 0.0, 2048, full)
    assert "59 points above the final model" in ahead and SFT_NOT_YARN in ahead
    assert _ablation_sentence(None, 0.5, 0.0, 2048, full) == "one of the two was not scored."


def test_the_needles_of_one_place_count_as_one_draw():
    """32 points over 22 needles is clearly a difference when the needles are independent, not when they are 2
    prompts at each of 11 places that share haystack and needle position (the full demo's grid)."""
    independent, paired = Scored(22, 22), Scored(22, 11)
    assert "points below" in _ablation_sentence(0.82, 0.5, 0.0, 2048, independent)
    level = _ablation_sentence(0.82, 0.5, 0.0, 2048, paired)
    assert "level with the final model (50% against 82%, 22 needles at 11 places each" in level
