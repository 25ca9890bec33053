"""Plots: the NIAH heatmap (length x depth, green = retrieved, as in the paper) and loss by position.

Figures are built on matplotlib's Agg canvas directly (no pyplot, no display, no global backend
state) and saved atomically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_ext.evaluate.io import save_figure_atomic
from megatron_ext.evaluate.niah import NiahResult
from megatron_ext.evaluate.perplexity import PerplexityResult

# Red -> yellow -> green, the colours of the NIAH heatmaps in the paper and the usual NIAH plots.
_NIAH_COLOURS = ["#F0496E", "#EBB839", "#0CD79F"]


def format_tokens(n: int) -> str:
    """1024 -> '1K', 4194304 -> '4M', 1536 -> '1.5K', 1000 -> '1000' (binary K and M, as the paper's 4M = 4,194,304)."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and (n * 10) % size == 0:
            value = n / size
            return f"{value:g}{unit}"
    return str(n)


def load_matplotlib() -> None:
    """Import the matplotlib modules the plots use. tools/niah.py does it before its work, its signals held
    (`interrupts_held`): the first heatmap imported them after a length was saved, and a Ctrl-C there once ended in a
    crash in Python's exit ('Fatal Python error: PyThreadState_Get', SIGABRT, status -6) after the run's
    `error: interrupted` line; a pybind11 extension of matplotlib's left half set up is the likely cause (as torch's)."""
    import importlib

    for name in ("matplotlib.backends.backend_agg", "matplotlib.colors", "matplotlib.figure"):
        importlib.import_module(name)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig


def plot_niah_heatmap(result: NiahResult | dict, path: str | Path, title: str | None = None) -> Path:
    """Heatmap PNG of a NIAH grid: x = context length, y = needle depth (0% on top), colour = score.

    Cells not run (skipped lengths, out of memory) are grey. Returns the written path.
    """
    from matplotlib.colors import LinearSegmentedColormap

    if isinstance(result, dict):
        result = NiahResult.from_dict(result)
    grid = np.array([[np.nan if s is None else s for s in row] for row in result.scores], dtype=float)  # [D, L]
    n_depth, n_len = grid.shape
    fig = _figure(max(6.0, 0.55 * n_len + 3.0), max(4.0, 0.4 * n_depth + 2.0))
    ax = fig.add_subplot(1, 1, 1)
    cmap = LinearSegmentedColormap.from_list("niah", _NIAH_COLOURS).with_extremes(bad="#BBBBBB")
    mesh = ax.pcolormesh(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, edgecolors="white", linewidth=0.8)
    tilt = n_len > 8
    ax.set_xticks(np.arange(n_len) + 0.5, [format_tokens(n) for n in result.lengths], rotation=45 if tilt else 0,
                  ha="right" if tilt else "center", rotation_mode="anchor" if tilt else "default")
    ax.set_yticks(np.arange(n_depth) + 0.5, [f"{d:g}" for d in result.depths])
    ax.invert_yaxis()  # depth 0% (needle at the start) on top, as in the paper
    max_pos = result.settings.get("max_position_embeddings")
    beyond = [i for i, n in enumerate(result.lengths) if max_pos and n > max_pos]
    if beyond and beyond[0] > 0:  # where the model's configured context ends
        ax.axvline(beyond[0], color="black", linestyle="--", linewidth=1.5)
        ax.text(beyond[0] - 0.05, 0.01, f"max_position_embeddings={format_tokens(max_pos)}", ha="right", va="bottom",
                transform=ax.get_xaxis_transform(), fontsize=7, bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    ax.set_xlabel("Token Limit")
    ax.set_ylabel("Depth Percent")
    acc = result.accuracy
    model = Path(str(result.settings.get("model") or "model")).name  # a directory's name, not its whole path
    ax.set_title(f"{title or f'Needle in a haystack: {model}'}\naccuracy {acc:.1%} over {int(np.isfinite(grid).sum())} "
                 "cells", fontsize=10)
    cbar = fig.colorbar(mesh, ax=ax)
    cbar.set_label("Score")
    if np.isnan(grid).any():
        fig.text(0.01, 0.005, "grey: not run (longer than max_position_embeddings, or out of memory)", fontsize=7)
    fig.tight_layout()
    return save_figure_atomic(fig, path)


def plot_perplexity(results: dict[str, PerplexityResult | dict], path: str | Path, title: str | None = None,
                    mark: dict[str, int] | None = None) -> Path:
    """Loss-by-position PNG: one line per labelled result, x = token position (log scale).

    `mark`: optional vertical lines, e.g. {"trained length": 131072}. Returns the written path.
    """
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    for label, res in results.items():
        if isinstance(res, dict):
            res = PerplexityResult.from_dict(res)
        pts = [(np.sqrt(b["start"] * max(b["end"] - 1, b["start"])), b["mean_loss"])
               for b in res.buckets if b["tokens"]]  # x: geometric middle of the bucket
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=label)
    for text, x in (mark or {}).items():
        ax.axvline(x, color="grey", linestyle="--", linewidth=1)
        ax.text(x, ax.get_ylim()[1], f" {text}", va="top", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_token_formatter())
    ax.set_xlabel("Token position (context so far)")
    ax.set_ylabel("Mean loss (nats/token)")
    ax.set_title(title or "Loss by position", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure_atomic(fig, path)


def _token_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _: format_tokens(int(round(x))) if x >= 1 else "")
