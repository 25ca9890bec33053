"""Accuracy check of a fake-quantized model against the same model with its quantizers bypassed.

Per held-out window (one forward each way): per-token negative log-likelihood, the relative
Frobenius error of the logits ||Lq - L||/||L||, and top-1 agreement. Perplexity is reported on
prefixes of a few lengths (causal, so the prefix of a window is a shorter context), with NIAH
accuracy at the same lengths when `megatron_ext.evaluate` is importable and a tokenizer exists.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from megatron_ext.quantize.fp8 import quantizers_disabled

LOGIT_CHUNK = 4096  # positions per lm_head call: [chunk, vocab] fp32 logits, 2 GB at Llama's vocab


@dataclass
class CheckResult:
    """The check's numbers; `rows`: one dict per length (ppl and NIAH of both models)."""

    rows: list[dict]
    logits_rel_err: float
    top1_agreement: float
    ppl_increase: float  # ppl_fp8 / ppl_orig - 1 at the longest length
    passed: bool
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def _window_stats(model, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [L, H] after the final norm, and per-token NLL [L-1] of w (shape [L])."""
    device = next(model.parameters()).device
    ids = w[None].to(device)  # [1, L]
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]  # [L, H]
    nll = torch.empty(len(w) - 1, dtype=torch.float64)
    for s in range(0, len(w) - 1, LOGIT_CHUNK):
        e = min(s + LOGIT_CHUNK, len(w) - 1)
        logits = model.lm_head(h[s:e]).float()  # [c, V]
        nll[s:e] = F.cross_entropy(logits, ids[0, s + 1:e + 1], reduction="none").double().cpu()
    return h, nll


@torch.no_grad()
def compare(model, windows: Sequence[torch.Tensor]) -> dict:
    """NLL per token of both models ([N, L-1] each), logits relative error and top-1 agreement."""
    nll_ref, nll_q = [], []
    diff2 = ref2 = 0.0
    agree = total = 0
    for w in windows:
        with quantizers_disabled(model):
            h_ref, n_ref = _window_stats(model, w)
        h_q, n_q = _window_stats(model, w)
        nll_ref.append(n_ref)
        nll_q.append(n_q)
        for s in range(0, len(w), LOGIT_CHUNK):
            lr = model.lm_head(h_ref[s:s + LOGIT_CHUNK]).float()  # [c, V]; lm_head is not quantized
            lq = model.lm_head(h_q[s:s + LOGIT_CHUNK]).float()
            diff2 += float((lq - lr).double().pow(2).sum())
            ref2 += float(lr.double().pow(2).sum())
            agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
            total += lr.shape[0]
    return {"nll_orig": torch.stack(nll_ref), "nll_fp8": torch.stack(nll_q),
            "logits_rel_err": math.sqrt(diff2 / max(ref2, 1e-30)), "top1_agreement": agree / max(total, 1)}


def check_lengths(seq_length: int, count: int = 3) -> list[int]:
    """`count` lengths up to `seq_length`, halving: e.g. 1M -> [256K, 512K, 1M]."""
    return sorted({max(2, seq_length >> i) for i in range(count)})


def _niah(model, tokenizer, lengths: list[int], notes: list[str]) -> tuple[dict | None, dict | None]:
    """NIAH accuracy per length for the original and the FP8 model, or (None, None) with a note."""
    if tokenizer is None:
        notes.append("NIAH skipped: the model directory has no tokenizer")
        return None, None
    try:
        from megatron_ext.evaluate import run_niah
    except ImportError as e:
        notes.append(f"NIAH skipped: megatron_ext.evaluate is not importable ({e})")
        return None, None

    def acc(m, n: int) -> float | None:
        r = run_niah(m, tokenizer, [n], [0, 50, 100], progress=False, log=None)
        return _mean([row[0] for row in r.scores])
    ref: dict = {}
    fp8: dict = {}
    for n in lengths:
        try:
            with quantizers_disabled(model):
                ref[n] = acc(model, n)
            fp8[n] = acc(model, n)
        except ValueError as e:  # EvalError: e.g. a length shorter than the NIAH prompt itself
            notes.append(f"NIAH at {n:,} tokens skipped: {e}")
    return (ref, fp8) if ref else (None, None)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def run_check(model, windows: Sequence[torch.Tensor], tokenizer=None, *, lengths: Sequence[int] | None = None,
              max_ppl_increase: float = 0.05, max_logits_rel_err: float = 0.15, max_niah_drop: float = 0.2,
              niah: bool = True) -> CheckResult:
    """Compare the fake-quant model with its original on held-out `windows` (each [L]); thresholds decide `passed`."""
    seq = len(windows[0])
    lengths = sorted(lengths or check_lengths(seq))
    stats = compare(model, windows)
    notes: list[str] = []
    niah_ref, niah_q = _niah(model, tokenizer, lengths, notes) if niah else (None, None)
    if not niah:
        notes.append("NIAH skipped (--no-niah)")
    rows = []
    for n in lengths:
        p_ref = math.exp(float(stats["nll_orig"][:, :n - 1].mean()))
        p_q = math.exp(float(stats["nll_fp8"][:, :n - 1].mean()))
        row = {"length": n, "ppl_orig": p_ref, "ppl_fp8": p_q, "ppl_increase": p_q / p_ref - 1}
        if niah_ref is not None:
            row.update(niah_orig=niah_ref.get(n), niah_fp8=niah_q.get(n))  # None: skipped, see notes
        rows.append(row)
    failures = []
    last = rows[-1]
    if not last["ppl_increase"] <= max_ppl_increase:  # `not <=` also catches NaN
        failures.append(f"perplexity at {last['length']:,} tokens rose {100 * last['ppl_increase']:.2f}% "
                        f"(limit {100 * max_ppl_increase:.2f}%)")
    if not stats["logits_rel_err"] <= max_logits_rel_err:
        failures.append(f"logits relative error {stats['logits_rel_err']:.4f} > {max_logits_rel_err}")
    for r in rows:
        if r.get("niah_orig") is not None and r.get("niah_fp8") is not None \
                and r["niah_orig"] - r["niah_fp8"] > max_niah_drop:
            failures.append(f"NIAH at {r['length']:,} tokens fell {r['niah_orig']:.2f} -> {r['niah_fp8']:.2f}")
    return CheckResult(rows, stats["logits_rel_err"], stats["top1_agreement"], last["ppl_increase"],
                       not failures, failures, notes)


def format_table(result: CheckResult) -> str:
    """The check as a fixed-width table, with the overall verdict and notes."""
    has_niah = any("niah_orig" in r for r in result.rows)
    head = f"{'length':>10} {'ppl orig':>10} {'ppl fp8':>10} {'change':>8}"
    head += f" {'NIAH orig':>9} {'NIAH fp8':>9}" if has_niah else ""
    lines = [head]
    for r in result.rows:
        line = f"{r['length']:>10,} {r['ppl_orig']:>10.4g} {r['ppl_fp8']:>10.4g} {100 * r['ppl_increase']:>+7.2f}%"
        if has_niah:
            fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
            line += f" {fmt(r.get('niah_orig')):>9} {fmt(r.get('niah_fp8')):>9}"
        lines.append(line)
    lines.append(f"logits relative error {result.logits_rel_err:.4f}, top-1 agreement {100 * result.top1_agreement:.2f}%")
    lines += [f"note: {n}" for n in result.notes]
    lines.append("check: PASS" if result.passed else "check: FAIL: " + "; ".join(result.failures))
    return "\n".join(lines)
