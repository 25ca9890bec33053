"""What the NIAH heatmap and the loss-by-position plot show (megatron_ext.evaluate.plots), read back from the
figure itself: the other tests only check that a PNG was written, so a heatmap with its depths upside down, its
not-run cells painted red (score 0), its max_position_embeddings line one column off or a title counting cells
that never ran passed them (mutation audit round 7).

The figure is taken on its way to `save_figure_atomic`, which still writes the PNG: nothing is replaced."""

import math

import numpy as np
import pytest

from megatron_ext.evaluate import plots
from megatron_ext.evaluate.niah import NiahResult
from megatron_ext.evaluate.perplexity import PerplexityResult


@pytest.fixture
def saved(monkeypatch):
    """The figures the plots save (the real save runs)."""
    figs = []
    real = plots.save_figure_atomic

    def keep(fig, path):
        figs.append(fig)
        return real(fig, path)

    monkeypatch.setattr(plots, "save_figure_atomic", keep)
    return figs


@pytest.mark.parametrize("n, text", [(1024, "1K"), (1536, "1.5K"), (131072, "128K"), (1 << 20, "1M"),
                                     (4_194_304, "4M"), (3 << 19, "1.5M"), (1 << 30, "1024M"), (1000, "1000"),
                                     (1023, "1023"), (1100, "1100"), (1_000_000, "1000000"), (64, "64")])
def test_format_tokens_binary_units(n, text):
    """The paper's 4M is 4,194,304 tokens: binary K and M, the larger unit first, a tenth of one at most (1.5K,
    not 1.0742K; 1100 stays as it is)."""
    assert plots.format_tokens(n) == text


def _axes(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"][0]


def test_heatmap_axes_cells_and_the_max_position_line(saved, tmp_path):
    lengths, depths = [512, 1024, 2048, 4096], [0.0, 50.0, 100.0]
    scores = [[1.0, 0.5, 0.0, None],  # depth 0
              [1.0, 1.0, 0.25, None],  # depth 50
              [0.0, 1.0, 1.0, None]]  # depth 100
    res = NiahResult(lengths, depths, scores, settings={"max_position_embeddings": 2048,
                                                        "model": str(tmp_path / "runs" / "llama-4m")})
    path = plots.plot_niah_heatmap(res.to_dict(), tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = _axes(saved[0])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "1K", "2K", "4K"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "50", "100"]
    np.testing.assert_allclose(ax.get_yticks(), [0.5, 1.5, 2.5])  # row i of the grid is depths[i]
    assert ax.yaxis_inverted()  # depth 0% on top, as in the paper
    mesh = ax.collections[0]
    cells = np.ma.asarray(mesh.get_array()).reshape(3, 4)
    assert cells.mask[:, 3].all() and not cells.mask[:, :3].any()  # not run: masked (grey), not a score of 0
    np.testing.assert_array_equal(cells[:, :3], np.array(scores)[:, :3].astype(float))
    assert (mesh.norm.vmin, mesh.norm.vmax) == (0.0, 1.0)  # a grid of 1s stays green, not the colour scale's bottom
    cmap = mesh.get_cmap()
    np.testing.assert_allclose(cmap(0.0)[:3], [0xF0 / 255, 0x49 / 255, 0x6E / 255], atol=0.01)  # 0: red
    np.testing.assert_allclose(cmap(1.0)[:3], [0x0C / 255, 0xD7 / 255, 0x9F / 255], atol=0.01)  # 1: green
    np.testing.assert_allclose(cmap(np.ma.masked_invalid([np.nan]))[0][:3], [0xBB / 255] * 3, atol=0.01)
    # the dashed line sits between the last length within max_position_embeddings (2048 = 2K) and the first beyond
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [3, 3]
    assert "max_position_embeddings=2K" in [t.get_text() for t in ax.texts]
    title = ax.get_title()
    assert title.startswith("Needle in a haystack: llama-4m\n")  # the folder's name, not its whole path
    acc = np.mean([s for row in scores for s in row if s is not None])
    assert title.endswith(f"accuracy {acc:.1%} over 9 cells")  # the cells that ran
    assert any(t.get_text().startswith("grey: not run") for t in saved[0].texts)


def test_heatmap_of_a_full_grid_has_no_line_or_grey_note(saved, tmp_path):
    """Every length within max_position_embeddings (the longest equal to it): no line, no note about grey cells;
    a --title replaces the model's name."""
    res = NiahResult([1024, 2048], [0.0, 100.0], [[1.0, 1.0], [1.0, 0.5]], settings={"max_position_embeddings": 2048})
    plots.plot_niah_heatmap(res, tmp_path / "h.png", title="mine")
    ax = _axes(saved[0])
    assert len(ax.get_lines()) == 0 and len(ax.texts) == 0
    assert len(saved[0].texts) == 0
    assert ax.get_title() == "mine\naccuracy 87.5% over 4 cells"
    mesh = ax.collections[0]
    assert (mesh.norm.vmin, mesh.norm.vmax) == (0.0, 1.0)  # the scale is the score's, not this grid's 0.5..1


def test_perplexity_points_skip_empty_buckets_and_marks_are_drawn(saved, tmp_path):
    buckets = [{"start": 1, "end": 2, "tokens": 5, "mean_loss": 3.0},
               {"start": 2, "end": 4, "tokens": 10, "mean_loss": 2.5},
               {"start": 4, "end": 8, "tokens": 0, "mean_loss": None},  # no document reached it
               {"start": 8, "end": 16, "tokens": 8, "mean_loss": 2.0}]
    res = PerplexityResult(buckets, 1, [16])
    plots.plot_perplexity({"final": res, "again": res.to_dict()}, tmp_path / "p.png", mark={"trained": 8})
    ax = _axes(saved[0])
    final, again, mark = ax.get_lines()
    # x: the geometric middle of each bucket's first and last position (end is exclusive)
    np.testing.assert_allclose(final.get_xdata(), [1.0, math.sqrt(2 * 3), math.sqrt(8 * 15)])
    np.testing.assert_allclose(final.get_ydata(), [3.0, 2.5, 2.0])
    assert (final.get_label(), again.get_label()) == ("final", "again")
    assert list(mark.get_xdata()) == [8, 8] and " trained" in [t.get_text() for t in ax.texts]
    assert ax.get_xscale() == "log" and ax.get_title() == "Loss by position"
    fmt = ax.xaxis.get_major_formatter()
    assert (fmt(1024, 0), fmt(1.0, 0), fmt(0.5, 0)) == ("1K", "1", "")
    plots.plot_perplexity({"x": res}, tmp_path / "q.png", title="step 100")
    assert _axes(saved[1]).get_title() == "step 100"


def test_a_wide_heatmap_tilts_its_lengths_and_grows(saved, tmp_path):
    """Up to 8 lengths the labels stand upright; beyond, 45 degrees (anchored right, under their column), and the
    figure widens and heightens with the grid so that the cells stay readable (mutation audit round 9)."""
    depths = [0.0, 50.0, 100.0]
    for n_len in (8, 9):
        lengths = [256 * (i + 1) for i in range(n_len)]
        plots.plot_niah_heatmap(NiahResult(lengths, depths, [[1.0] * n_len for _ in depths]), tmp_path / "h.png")
    upright, tilted = (_axes(f).get_xticklabels() for f in saved)
    assert {t.get_rotation() for t in upright} == {0.0} and {t.get_ha() for t in upright} == {"center"}
    assert {t.get_rotation() for t in tilted} == {45.0} and {t.get_ha() for t in tilted} == {"right"}
    big = [1 << (10 + i) for i in range(20)]
    grid = NiahResult(big, [float(d) for d in range(0, 101, 5)], [[1.0] * 20] * 21)
    plots.plot_niah_heatmap(grid, tmp_path / "b.png")
    small_w, small_h = saved[0].get_size_inches()
    big_w, big_h = saved[2].get_size_inches()
    assert big_w > small_w + 5 and big_h > small_h + 4


def test_positions_are_on_a_log2_axis_with_a_legend(saved, tmp_path):
    """Octaves of the position are evenly spaced (major ticks at powers of two, the buckets' own spacing) and each
    curve is named in the legend."""
    buckets = [{"start": 1 << k, "end": 2 << k, "tokens": 4, "mean_loss": 5.0 - k / 4} for k in range(12)]
    res = PerplexityResult(buckets, 1, [4096])
    plots.plot_perplexity({"base": res, "extended": res}, tmp_path / "p.png")
    ax = _axes(saved[0])
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 4096]
    assert len(ticks) >= 3 and all(math.log2(t).is_integer() for t in ticks), ticks
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["base", "extended"]


def test_no_max_position_line_at_the_left_edge(saved, tmp_path):
    """Every length beyond max_position_embeddings (a --force run): no line and no label drawn on the axis at x = 0,
    where there is no column of lengths within the window to separate (mutation audit round 9)."""
    res = NiahResult([512, 1024], [0.0, 100.0], [[1.0, 0.0], [0.0, 0.0]], settings={"max_position_embeddings": 256})
    plots.plot_niah_heatmap(res, tmp_path / "h.png")
    ax = _axes(saved[0])
    assert len(ax.get_lines()) == 0 and len(ax.texts) == 0
