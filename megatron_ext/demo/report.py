"""demo_out/REPORT.md: NIAH accuracy per context length for each model, heatmaps, perplexity plot, step times."""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.demo.pipeline import ABLATION
from megatron_ext.evaluate.io import write_json_atomic, write_text_atomic


@dataclass(frozen=True)
class Scored:
    """What one accuracy of a NIAH grid rests on: `needles` prompts scored, at `places` distinct needle places
    (depths). The prompts of a place share haystack and needle position and differ only in the value, so they are
    not independent draws: a difference between two accuracies is weighed against the places."""

    needles: int
    places: int

    def __str__(self) -> str:  # '1 needle', '22 needles at 11 places'
        text = f"{self.needles} needle{'' if self.needles == 1 else 's'}"
        return text + (f" at {self.places} places" if self.places < self.needles else "")


def _niah_rows(evals: Path, models: dict[str, Path]
               ) -> tuple[list[int], list[tuple[str, list, float, Path]], dict[str, list[Scored]]]:
    """Per model: accuracy per length, mean, heatmap; and per model what each length's accuracy rests on (what a
    difference between two accuracies has to be weighed against)."""
    rows, lengths, needles = [], [], {}
    for i, label in enumerate(models):
        res = json.loads((evals / f"niah{i}" / "results.json").read_text())
        lengths = res["lengths"]
        per_len = []
        for j, _ in enumerate(lengths):
            vals = [row[j] for row in res["scores"] if row[j] is not None]
            per_len.append(sum(vals) / len(vals) if vals else None)
        rows.append((label, per_len, res["accuracy"], evals / f"niah{i}" / "heatmap.png"))
        scored = [c for c in res.get("cells", []) if c.get("score") is not None]
        needles[label] = [Scored(sum(c.get("length") == n for c in scored),
                                 len({c.get("depth") for c in scored if c.get("length") == n})) for n in lengths]
    return lengths, rows, needles


def _megatron_engine_check(evals: Path, rows) -> dict | None:
    """The final model's grid on the Megatron engine against its transformers run: per length, cells that agree."""
    path = evals / "megatron_niah" / "results.json"
    hf = next((png.parent / "results.json" for label, _, _, png in rows if label == "after CPT + SFT"), None)
    if not path.is_file() or hf is None:
        return None
    ours, theirs = json.loads(path.read_text()), json.loads(hf.read_text())
    by_length = []
    for j, _ in enumerate(ours["lengths"]):
        vals = [row[j] for row in ours["scores"] if row[j] is not None]
        by_length.append(sum(vals) / len(vals) if vals else None)
    key = lambda c: (c["length"], c["depth"], c.get("sample"))  # noqa: E731 - the cell's place in the grid
    scored = {key(c): c["score"] for c in theirs["cells"]}
    same = sum(scored.get(key(c)) == c["score"] for c in ours["cells"])
    settings = ours["settings"]
    return {"by_length": by_length, "cells": len(ours["cells"]), "same_cells": same,
            "forward_passes": settings.get("forward_passes"), "extension_passes": settings.get("extension_passes", 0),
            "decode_steps": settings.get("decode_steps")}


def _cell(v: float | None) -> str:
    """An accuracy as the table shows it."""
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _clearly_above(a: float | None, b: float | None, scored: Scored) -> bool:
    """Whether exact-match rate `a` beats `b` by more than two standard errors of their difference, both over
    `scored.places` independent places (pooled rate; the needles of a place count as one draw, which overstates
    the error where they differ). Below that a needle or two decides it: the quick demo scores 2 needles per length,
    the full one 22 at 11 places, and reruns of the full one move by a few needles (README, 'The demo')."""
    n = scored.places
    if a is None or b is None or n <= 0:
        return False
    p = (a + b) / 2
    return a - b > 2 * math.sqrt(max(0.0, 2 * p * (1 - p) / n))  # max: p a rounding above 1


def _fewest(needles: dict[str, Scored], labels) -> Scored:
    """The least of what the accuracies of `labels` rest on (nothing for a model not scored)."""
    counts = [needles.get(label, Scored(0, 0)) for label in labels]
    return Scored(min(c.needles for c in counts), min(c.places for c in counts))


def _stage_sentences(at8x: dict[str, float | None], needles: dict[str, Scored], length: int) -> str:
    """What the CPT and the SFT did for retrieval at `length` (8x the base context), from their accuracies there
    against the base's and each other's (`needles`: what each model's accuracy at `length` rests on)."""
    base, cpt, sft = at8x.get("base"), at8x.get("after YaRN CPT"), at8x.get("after CPT + SFT")

    def n(*labels: str) -> Scored:
        return _fewest(needles, labels)

    cpt_rebuilds = _clearly_above(cpt, base, n("after YaRN CPT", "base"))
    text = "The CPT is the paper's: next-token loss over every token of 2048-token rows. "
    if cpt_rebuilds:
        text += (f"Here it rebuilds retrieval beyond the base context: {_cell(cpt)} at {length:,} tokens against the "
                 f"base's {_cell(base)}. ")
    else:
        text += (f"Here it does not by itself rebuild retrieval beyond the base context ({_cell(cpt)} at "
                 f"{length:,} tokens, not clearly above the base's {_cell(base)}; README, 'The demo', says what was "
                 "tried). ")
    sft_what = ("The SFT, whose loss is on the answer only, over needle questions up to 2048 tokens with the CPT's "
                "YaRN RoPE,")
    if "after CPT + SFT" not in at8x:
        return text + "The SFT step failed (sft.log): there is no SFT model to score."
    sft_n = n("after CPT + SFT", "after YaRN CPT", "base")
    # "does" only where the numbers say so: above the CPT model and the base by more than a needle or two
    above_cpt = _clearly_above(sft, cpt, sft_n)
    if above_cpt and _clearly_above(sft, base, sft_n):
        return text + f"{sft_what} {'raises it to' if cpt_rebuilds else 'does:'} {_cell(sft)} at {length:,} tokens."
    # name the model it does not beat: above the CPT model but not the base, "not above the CPT model" was false
    behind = "the base" if above_cpt else "the CPT model"
    text += f"{sft_what} scores {_cell(sft)} there, not clearly above {behind} ({sft_n} each)"
    if not any(_clearly_above(v, base, sft_n) for v in (cpt, sft)):
        return text + ": the run is too small or too short to show what either stage adds."
    return text + "."


def _ablation_sentence(final: float | None, ablation: float | None, base: float | None, length: int,
                       n: Scored) -> str:
    """What the ablation says of the YaRN extension at `length`, from the final model's, the ablation's and the
    base's accuracies there, each resting on `n`."""
    if final is None or ablation is None:
        return "one of the two was not scored."
    scores = f"{_cell(ablation)} against {_cell(final)}, {n} each"
    if _clearly_above(final, ablation, n):
        return (f"at {length:,} it scores {round(100 * (final - ablation))} points below the final model ({scores}): "
                "what the YaRN extension adds here.")
    if not (_clearly_above(ablation, base, n) or _clearly_above(final, base, n)):
        # e.g. all 0% after the quick demo's few steps: "level with" would read as a result
        return (f"at {length:,} it scores {_cell(ablation)} and the final model {_cell(final)} ({n} each), "
                f"neither clearly above the base's {_cell(base)}: the run is too small or too short to compare them.")
    above = _clearly_above(ablation, final, n)
    where = (f"{round(100 * (ablation - final))} points above the final model ({scores})" if above
             else f"level with the final model ({scores}, a difference within the noise)")
    if not _clearly_above(ablation, base, n):
        return f"at {length:,} it scores {where}."
    return (f"at {length:,} it scores {where}: at this scale the SFT, not the YaRN extension, brings retrieval at 8x "
            "(the base's llama3 RoPE already stretches its wavelengths by 8; README, 'The demo').")


def _param_count(hf_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in hf_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def write_report(out: Path, models: dict[str, Path], steps, settings, total_s: float) -> Path:
    """Write `out/REPORT.md` (and `out/results.json`) from the evaluation outputs; return the report path."""
    from megatron_ext.evaluate import PerplexityResult, plot_perplexity

    evals = out / "eval"
    lengths, rows, needles = _niah_rows(evals, models)
    ppl = {}
    for tag in ("base", "cpt", "final"):
        f = evals / f"ppl_{tag}" / "ppl.json"
        if f.is_file():
            d = json.loads(f.read_text())
            ppl[d.get("settings", {}).get("label") or tag] = PerplexityResult.from_dict(d)
    ppl_png = plot_perplexity(ppl, out / "perplexity_by_position.png", title="Loss by token position",
                              mark={"base context (256)": 256})

    rel = lambda p: os.path.relpath(p, out)  # noqa: E731
    c = json.loads((models["base"] / "config.json").read_text())
    n_params = _param_count(models["base"])
    lines = ["# `make demo`: YaRN context extension at toy scale", "",
             f"A tiny Llama-3.1-shaped model ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, GQA "
             f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, {n_params / 1e6:.2f}M parameters, llama3 "
             "RoPE over an original context of 256) trained at 256 tokens stands in for Llama-3.1-8B-Instruct at 128K. One YaRN CPT stage "
             "(factor 8, beta_fast 4, beta_slow 1) at 8x its context (2048 tokens, CP=2 on two gloo processes) "
             "extends it as the paper extends 128K to 1M; an SFT on chat-formatted needle questions follows "
             "(SFT models are asked in their chat format, the others as plain text). NIAH: exact match of the 7-digit "
             f"needle value, {settings.samples} needle(s) per (length, depth) cell, depths {settings.depths}.", "",
             "## NIAH accuracy by context length", "",
             "| model | " + " | ".join(f"{n:,}" for n in lengths) + " | mean |",
             "|---|" + "---:|" * (len(lengths) + 1)]
    for label, per_len, acc, _ in rows:
        lines.append(f"| {label} | " + " | ".join(_cell(v) for v in per_len) + f" | {_cell(acc)} |")
    at8x = {label: per_len[-1] for label, per_len, _, _ in rows}  # accuracy at 8x the base context
    base8x = at8x["base"]
    n8x = {label: counts[-1] for label, counts in needles.items()}  # needles scored there

    def goal(label: str) -> bool:
        v = at8x.get(label)
        return v is not None and base8x is not None and v >= 0.8 and base8x <= 0.3

    met = {label: goal(label) for label in at8x if label not in ("base", "base + YaRN, no training", ABLATION)}
    lines += ["", f"At 8x the base context ({lengths[-1]:,} tokens): "
              + "; ".join(f"{label} {_cell(v)}" for label, v in at8x.items()) + ".",
              "Goal (>= 80% after the extension where the base is <= 30%): "
              + "; ".join(f"{label}: **{'met' if ok else 'not met'}**" for label, ok in met.items()) + ".", "",
              _stage_sentences(at8x, n8x, lengths[-1]) + " "
              "The ablation runs the same SFT from the base with the base's own RoPE (no YaRN, no CPT): "
              + _ablation_sentence(at8x.get("after CPT + SFT"), at8x.get(ABLATION), base8x, lengths[-1],
                                   _fewest(n8x, ("after CPT + SFT", ABLATION, "base"))), "",
              "## Heatmaps", ""]
    for label, _, _, png in rows:
        lines += [f"**{label}**", "", f"![{label}]({rel(png)})", ""]
    engine = _megatron_engine_check(evals, rows)
    if engine is not None:
        lines += ["## The final model on the Megatron engine", "",
                  "`tools/niah.py --megatron CKPT --engine megatron --cp 2` runs the same grid on the SFT checkpoint "
                  "itself, under torchrun on two processes (each prompt split in zigzag CP chunks, no conversion, the "
                  "KV cache spread over the CP ranks): how a 1M-4M-token model is evaluated on a cluster (README, "
                  "'Beyond one GPU').", "",
                  "| engine | " + " | ".join(f"{n:,}" for n in lengths) + " |", "|---|" + "---:|" * len(lengths),
                  "| Megatron, CP 2 | " + " | ".join(_cell(v) for v in engine["by_length"]) + " |", "",
                  f"Cells scored as by transformers: {engine['same_cells']} of {engine['cells']}; "
                  f"{engine['forward_passes']} forward passes over the prompts"
                  + (f", {engine['extension_passes']} over their tokens after the haystack shared with the prompt "
                     "before" if engine["extension_passes"] else "")
                  + f" and {engine['decode_steps']} decode steps for {engine['cells']} prompts (greedy decoding "
                  "checked against the needle as a draft).", ""]
    lines += ["## Loss by token position", "", f"![perplexity by position]({rel(ppl_png)})", "",
              "| model | mean loss |", "|---|---:|"]
    lines += [f"| {k} | {v.mean_loss:.4f} |" for k, v in ppl.items()]
    lines += ["", "## Time per step", "", "| step | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in steps.seconds.items()]
    lines += [f"| **total** | **{total_s:.1f}** |", "",
              f"Machine: {platform.machine()}, {os.cpu_count()} CPU(s), torch CPU kernels "
              f"{torch.backends.cpu.get_cpu_capability()}, load average at the end "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.", "",
              "Settings: `" + json.dumps(settings.__dict__ if hasattr(settings, '__dict__') else {}, default=str) + "`", ""]
    report = out / "REPORT.md"
    write_text_atomic(report, "\n".join(lines))
    results = {"lengths": lengths, "niah": {label: {"by_length": per_len, "mean": acc} for label, per_len, acc, _ in rows},
               "goal_met": met, "seconds": steps.seconds, "total_s": total_s,
               "mean_loss": {k: v.mean_loss for k, v in ppl.items()}, "megatron_engine": engine}
    write_json_atomic(out / "results.json", results)
    return report
