"""The demo's REPORT.md and results.json (megatron_ext/demo/report.py) say what the evaluation grids hold: cells not
run are "n/a" and count as no needle, the Megatron engine's agreement is counted cell by cell, the goal is judged at
its own bounds, and no sentence claims more than the numbers carry. Pins the mutants of mutation audit round 8 (DR
ids in the docstrings)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_ext.demo.pipeline import ABLATION, DemoSettings, StepLog
from megatron_ext.demo.report import Scored, _ablation_sentence, _clearly_above, write_report
from tests.unit.test_demo_report import LABELS, SFT_DOES, SFT_NOT_YARN, model_folders

FULL_DEPTHS = [float(d) for d in range(0, 101, 10)]
Score = Callable[[str, int, int, int], "float | None"]  # (label, length, depth index, sample) -> score, None: not run


def _grid(lengths: list[int], depths: list[float], samples: int, score: Callable[[int, int, int], float | None],
          settings: dict | None = None) -> dict:
    """A results.json as tools/niah.py writes it: cells (score None: not run, out of memory), the depth x length
    grid of their means (None where nothing ran) and the mean accuracy."""
    cells = []
    for n in lengths:
        for i, d in enumerate(depths):
            for s in range(samples):
                v = score(n, i, s)
                cells.append({"length": n, "depth": d, "sample": s, "score": v,
                              **({"error": "out of memory"} if v is None else {})})

    def mean(vals: list) -> float | None:
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    scores = [[mean([c["score"] for c in cells if c["length"] == n and c["depth"] == d]) for n in lengths]
              for d in depths]
    return {"lengths": lengths, "depths": depths, "scores": scores, "cells": cells, "settings": settings or {},
            "accuracy": mean([c["score"] for c in cells])}


def _hits(hits: dict[str, list[int]], depths: list[float], samples: int, lengths: list[int]) -> Score:
    """Scores where model `label` finds the first `hits[label][j]` needles (in depth, sample order) at length j."""
    def score(label: str, n: int, i: int, s: int) -> float:
        return float(i * samples + s < hits[label][lengths.index(n)])
    return score


def _demo(tmp_path: Path, score: Score, *, labels=LABELS, lengths=(256, 512, 1024, 2048), depths=FULL_DEPTHS,
          samples: int = 2) -> tuple[Path, dict[str, Path], DemoSettings]:
    """demo_out as the pipeline leaves it before the report: the base model's config and each model's NIAH grid."""
    out = tmp_path / "demo_out"
    models = model_folders(out, labels)
    for i, label in enumerate(labels):
        (out / "eval" / f"niah{i}").mkdir(parents=True)
        grid = _grid(list(lengths), depths, samples, lambda n, d, s, label=label: score(label, n, d, s))
        (out / "eval" / f"niah{i}" / "results.json").write_text(json.dumps(grid))
    settings = DemoSettings(lengths=tuple(lengths), depths=",".join(f"{d:g}" for d in depths), samples=samples)
    return out, models, settings


def _report(out: Path, models: dict[str, Path], settings: DemoSettings) -> str:
    write_report(out, models, StepLog(seconds={"cpt": 1.0}), settings, total_s=1.0)
    return (out / "REPORT.md").read_text()


def test_cells_not_run_are_no_needles(tmp_path):
    """A length whose cells all ran out of memory reads "n/a", not 0% (DR3) nor a TypeError (DR2); cells not run
    count as no needle in what a comparison rests on (DR4), and a comparison rests on the least scored of the models
    it names, the base included (DR13: the most, DR25: the ablation's without the base, DR28: the SFT's alone).
    Here the base ran one needle of two at each depth at 2,048."""
    def score(label: str, n: int, i: int, s: int) -> float | None:
        if n == 2048 and (label == "base + YaRN, no training" or (label == "base" and s == 1)):
            return None
        return 0.0

    report = _report(*_demo(tmp_path, score))
    assert "| base + YaRN, no training | 0% | 0% | 0% | n/a | 0% |" in report
    assert "base + YaRN, no training n/a;" in report
    assert "not clearly above the CPT model (11 needles each): the run is too small" in report
    assert "final model 0% (11 needles each), neither clearly above the base's 0%" in report


def test_a_failed_sft_is_named(tmp_path):
    """Without an SFT model (its step failed, so the pipeline scored none) the report says so and where to look,
    and the ablation has nothing to compare with (DR14: the SFT sentence went on with "n/a")."""
    labels = tuple(label for label in LABELS if label != "after CPT + SFT")
    report = _report(*_demo(tmp_path, lambda *cell: 0.0, labels=labels, lengths=(256, 2048), depths=[0.0, 100.0],
                            samples=1))
    assert "The SFT step failed (sft.log): there is no SFT model to score." in report
    assert "one of the two was not scored." in report and "## The final model on the Megatron engine" not in report


def test_the_megatron_engine_agreement_is_counted_cell_by_cell(tmp_path):
    """The Megatron engine's grid is compared with the SFT model's transformers grid (DR5: the CPT model's), cell by
    cell with the sample (DR8: two samples of a place were one), counting equal scores (DR7: any scored cell); its
    row has every length (DR29), the extension clause appears only with extension passes (DR9, DR27), and
    results.json holds the comparison (DR30). Here the two engines swap the scores of the two samples at
    (2,048, 100%): 6 of 8 cells agree."""
    lengths, depths = [256, 2048], [0.0, 100.0]
    out, models, settings = _demo(tmp_path, lambda label, n, i, s: float(label == "after CPT + SFT" and
                                                                         not (n == 2048 and i == 1 and s == 1)),
                                  lengths=lengths, depths=depths, samples=2)
    engine = out / "eval" / "megatron_niah"
    engine.mkdir()

    def write_engine(**settings_: int) -> None:
        grid = _grid(lengths, depths, 2, lambda n, i, s: float(not (n == 2048 and i == 1 and s == 0)), settings_)
        (engine / "results.json").write_text(json.dumps(grid))

    write_engine(forward_passes=8, decode_steps=20)
    report = _report(out, models, settings)
    assert "| Megatron, CP 2 | 100% | 75% |" in report
    assert ("Cells scored as by transformers: 6 of 8; 8 forward passes over the prompts and 20 decode steps for 8 "
            "prompts") in report
    assert json.loads((out / "results.json").read_text())["megatron_engine"] == {
        "by_length": [1.0, 0.75], "cells": 8, "same_cells": 6, "forward_passes": 8, "extension_passes": 0,
        "decode_steps": 20}
    write_engine(forward_passes=2, extension_passes=6, decode_steps=20)
    assert ("2 forward passes over the prompts, 6 over their tokens after the haystack shared with the prompt before "
            "and 20 decode steps") in _report(out, models, settings)


def test_the_goal_is_judged_at_its_bounds(tmp_path):
    """80% after the extension where the base has 30% meets the goal (">= 80%", "<= 30%": DR19, DR20); the ablation
    is no extension and is not judged (DR21), results.json says the same (DR26), and the table has a column per
    length and the mean (DR22). 10 needles per length: 2 at each of 5 depths."""
    depths, lengths = [0.0, 25.0, 50.0, 75.0, 100.0], [256, 2048]
    hits = {"base": [10, 3], "base + YaRN, no training": [0, 0], "after YaRN CPT": [0, 2], "after CPT + SFT": [10, 8],
            ABLATION: [10, 8]}
    out, models, settings = _demo(tmp_path, _hits(hits, depths, 2, lengths), lengths=lengths, depths=depths)
    report = _report(out, models, settings)
    assert "| after CPT + SFT | 100% | 80% | 90% |" in report and "\n|---|---:|---:|---:|\n" in report
    assert ("Goal (>= 80% after the extension where the base is <= 30%): after YaRN CPT: **not met**; "
            "after CPT + SFT: **met**.") in report
    assert json.loads((out / "results.json").read_text())["goal_met"] == {"after YaRN CPT": False,
                                                                          "after CPT + SFT": True}


def test_sentences_claim_what_each_comparison_shows(tmp_path):
    """22 needles at 11 places at 2,048: base 0%, CPT 27%, SFT 50%, ablation 27%. The SFT is clearly above the base
    but not the CPT model, so it does not "do" it, and the run is not called too small (DR17: judged on the CPT
    alone); the ablation is level with the final model and not clearly above the base, so the SFT is not credited
    over YaRN (DR18)."""
    hits = {"base": [22, 22, 11, 0], "base + YaRN, no training": [0, 0, 0, 0], "after YaRN CPT": [22, 22, 11, 6],
            "after CPT + SFT": [22, 22, 22, 11], ABLATION: [22, 22, 22, 6]}
    report = _report(*_demo(tmp_path, _hits(hits, FULL_DEPTHS, 2, [256, 512, 1024, 2048])))
    assert SFT_DOES not in report and SFT_NOT_YARN not in report
    assert "scores 50% there, not clearly above the CPT model (22 needles at 11 places each). The ablation" in report
    assert ("at 2,048 it scores level with the final model (27% against 50%, 22 needles at 11 places each, a "
            "difference within the noise).\n") in report


def test_the_sft_is_not_said_to_rebuild_what_the_base_had(tmp_path):
    """Base 82%, CPT 0%, SFT 91% at 2,048 (22 needles at 11 places): the SFT beats the CPT model but not the base,
    so the report does not say it rebuilds retrieval (DR15: above the CPT model was enough), and it names the base
    as what the SFT is not clearly above (it said "not clearly above the CPT model", 91% against 0%)."""
    hits = {"base": [22, 22, 22, 18], "base + YaRN, no training": [0, 0, 0, 0], "after YaRN CPT": [0, 0, 0, 0],
            "after CPT + SFT": [22, 22, 22, 20], ABLATION: [22, 22, 22, 20]}
    report = _report(*_demo(tmp_path, _hits(hits, FULL_DEPTHS, 2, [256, 512, 1024, 2048])))
    assert "| after CPT + SFT | 100% | 100% | 100% | 91% |" in report
    assert SFT_DOES not in report and "raises it to" not in report
    assert "scores 91% there, not clearly above the base (22 needles at 11 places each)" in report


def test_the_difference_is_weighed_at_the_pooled_rate():
    """100% against 91% at 11 places is within the noise: the error is that of the pooled rate (DR11: the higher
    rate's, which is 0 at 100%, made any difference a result); one needle is "1 needle" (DR1); nothing scored claims
    nothing and divides by nothing (DR10)."""
    level = _ablation_sentence(1.0, 10 / 11, 0.0, 2048, Scored(22, 11))
    assert level.startswith("at 2,048 it scores level with the final model (91% against 100%, 22 needles at 11 "
                            "places each, a difference within the noise)"), level
    assert "(1 needle each)" in _ablation_sentence(0.0, 0.0, 0.0, 256, Scored(1, 1))
    assert _clearly_above(1.0, 0.0, Scored(0, 0)) is False


def test_loss_labels_and_parameter_count(tmp_path):
    """The loss table names each curve by the label its ppl.json carries (DR23: the folder's tag, "cpt"), and the
    parameter count adds up every safetensors file of a sharded model (DR24: the last file's only)."""
    out, models, settings = _demo(tmp_path, lambda *cell: 0.0, lengths=(256, 2048), depths=[0.0, 100.0], samples=1)
    save_file({"a": torch.zeros(30000)}, str(models["base"] / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(100, 200)}, str(models["base"] / "model-00002-of-00002.safetensors"))
    for tag, label, loss in (("base", "base", 3.0), ("cpt", "after YaRN CPT", 2.5)):
        (out / "eval" / f"ppl_{tag}").mkdir()
        (out / "eval" / f"ppl_{tag}" / "ppl.json").write_text(json.dumps({
            "buckets": [{"start": 1, "end": 256, "tokens": 100, "mean_loss": loss, "perplexity": 1.0}],
            "documents": 1, "doc_tokens": [256], "settings": {"label": label}}))
    report = _report(out, models, settings)
    assert "| after YaRN CPT | 2.5000 |" in report and "| base | 3.0000 |" in report
    assert "0.05M parameters" in report
