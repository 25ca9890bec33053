"""Pins of `tools/plan.py`'s printed plan (megatron_ext.plan_cli) from the mutation audit (round 9): the lines of the
table a user reads (labels, the tokens per GPU, the MFU asked for, the tight flag, the paper's hours) and the flags
that reach the planner, against hand computations and the plan model (megatron_ext.plan) called directly."""

from __future__ import annotations

from megatron_ext.cost_model import RECOMPUTE_MODES, resolve_gpu
from megatron_ext.plan import min_context, recommend
from megatron_ext.plan_cli import main
from megatron_ext.recipe import load_recipe
from tests.conftest import ROOT

R = ROOT / "recipes"
CPT_1M = str(R / "cpt_1m.yaml")


def _run(capsys, *argv) -> tuple[int, str, str]:
    """tools/plan.py ARGV in this process: (exit status, stdout, stderr), a sys.exit(text) read as 1 and its text."""
    try:
        rc, said = main(list(argv)), ""
    except SystemExit as e:
        rc, said = (1, str(e.code)) if isinstance(e.code, str) else (e.code or 0, "")
    out = capsys.readouterr()
    return rc, out.out, out.err + said


def _line(text: str, start: str) -> str:
    """The one table line that starts (after its indent) with `start`."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(start)]
    assert len(lines) == 1, (start, text)
    return lines[0]


def test_the_table_of_the_paper_recipe_line_by_line(capsys):
    """cpt_1m on its 256 H100s (TP 8, CP 4, TE kernels, both DP overlaps on in the recipe): 1,048,576 / CP 4 =
    262,144 tokens per GPU (PC5: divided by TP, 131,072); the CP line named for TE's ring (PC6: the local kernels'
    gathered K/V gradients); the compute at the --mfu asked for, 35% of H100's 989.4 TFLOP/s (PC8: the achieved
    MFU); both overlaps named (PC4: grad reduce read from overlap_param_gather); not tight at 48% (PC7)."""
    rc, out, _ = _run(capsys, CPT_1M)
    assert rc == 0
    assert _line(out, "activations").endswith("(262,144 tokens/GPU)")
    assert _line(out, "CP ring buffers")
    assert "CP gathered K/V gradients" not in out
    assert _line(out, "step: compute").endswith("s   (at 35% of 989.4 TFLOP/s BF16)")
    assert _line(out, "step: TP / CP(exposed) / DP comm").endswith("(DP overlapped: grad reduce and param gather)")
    assert _line(out, "total  ").endswith("of 80 GB: FITS")
    rc, out, _ = _run(capsys, CPT_1M, "--set", "train.overlap_param_gather=false", "--mfu", "0.4")
    assert rc == 0 and _line(out, "step: TP / CP(exposed) / DP comm").endswith("(DP overlapped: grad reduce)")
    assert _line(out, "step: compute").endswith("s   (at 40% of 989.4 TFLOP/s BF16)")
    _, out, _ = _run(capsys, CPT_1M, "--set", "runtime.attention=sdpa", "--set", "parallel.sequence_parallel=false")
    assert _line(out, "CP gathered K/V gradients") and "CP ring buffers" not in out


def test_a_tight_plan_and_a_recommendation_that_is_not(capsys):
    """cpt_1m at 2,686,976 tokens on 256 H100s: the recipe's layout fits at ~75.6 GB of 80 (94.5% > 90%: 'tight',
    PC7), while the recommendation, CP 32 without recompute, is below 90% and says no 'tight' (PC15: it took the
    recipe's layout's tightness)."""
    rc, out, _ = _run(capsys, CPT_1M, "--set", "train.seq_length=2686976")
    assert rc == 0
    total = _line(out, "total  ")
    assert total.endswith("of 80 GB: FITS (tight, > 90%)")
    assert 0.9 * 80 < float(total.split()[1]) <= 80
    rec = _line(out, "recommendation:")
    assert rec.startswith("recommendation: parallel.context=32 train.recompute=none (") and "tight" not in rec


def test_one_validation_is_in_the_table(capsys):
    """train.eval_interval = train.steps (125): one validation, at the last step, and its line (PC9: shown only
    from two on)."""
    rc, out, _ = _run(capsys, CPT_1M, "--set", "data.split=98,2,0", "--set", "train.eval_interval=125")
    assert rc == 0 and " x 1 (1 global batch(es) each, train.eval_interval 125)" in _line(out, "validation")


def test_the_paper_hours_only_at_the_papers_sequence_length(capsys):
    """The paper's 256 x H100 hours are for its sequence length: cpt_1m planned at 524,288 tokens prints no paper
    line (PC11: printed, with a ratio of two different runs)."""
    rc, out, _ = _run(capsys, CPT_1M)
    assert rc == 0 and _line(out, "paper (256 x H100")
    rc, out, _ = _run(capsys, CPT_1M, "--set", "train.seq_length=524288")
    assert rc == 0 and "paper" not in out


def test_fused_ce_reaches_the_smallest_cp_and_the_recommendation(capsys):
    """--fused-ce with the full loss head on 64 H100s: the fused logits (2 B x V/TP per token) let full recompute fit
    at CP 2 (4 unfused) and the recommendation recompute fewer layers; the table says so, as the plan model does
    with fused_ce=True (PC13, PC14: both planned unfused)."""
    argv = ["--gpus", "64", "--set", "train.loss_head=full"]
    recipe, gpu = load_recipe(CPT_1M, argv[-1:], world_size=64), resolve_gpu("h100")
    fused = [min_context(recipe, gpu, 64, rc, True) for rc in RECOMPUTE_MODES]
    assert fused != [min_context(recipe, gpu, 64, rc, False) for rc in RECOMPUTE_MODES]  # the case tells them apart
    best, plain = recommend(recipe, gpu, 64, 0.35, True), recommend(recipe, gpu, 64, 0.35, False)
    assert best.recompute_overrides != plain.recompute_overrides
    _, out, _ = _run(capsys, CPT_1M, *argv, "--fused-ce")
    assert _line(out, "smallest CP that fits:").startswith("smallest CP that fits: " + ", ".join(
        f"recompute {rc}: {cp if cp else 'none fits'}" for rc, cp in zip(RECOMPUTE_MODES, fused)) + " (")
    assert _line(out, "recommendation:").startswith(
        f"recommendation: parallel.context={best.context} {best.recompute_overrides} (")


def test_one_recipe_given_both_ways_and_no_gpus(capsys):
    """The same file as RECIPE and as --recipe is one recipe, planned (PC18: refused as two); --gpus 0 is one line
    naming the flag (PC20: passed on to the planner)."""
    rc, out, _ = _run(capsys, CPT_1M, "--recipe", CPT_1M)
    assert rc == 0 and out.startswith("plan: cpt_1m  on 256 x h100-80gb")
    assert _run(capsys, CPT_1M, "--gpus", "0") == (1, "", f"error: {CPT_1M}: --gpus = 0: must be >= 1")


def test_two_recipe_files_the_first_is_the_recipe(capsys):
    """RECIPE is the first positional that is not KEY=VALUE; a second file is an override, refused as one, the line
    naming the first as the recipe (PC41: the last file taken as the recipe)."""
    cpt_2m = str(R / "cpt_2m.yaml")
    assert _run(capsys, CPT_1M, cpt_2m) == (1, "", f"error: {CPT_1M}: override {cpt_2m!r}: expected dotted.key=value, "
                                                   "e.g. train.steps=10")


def test_an_evaluation_plans_the_recipes_attention_kernels(capsys):
    """--eval of a recipe on torch's SDPA attention (no TE) plans the local kernels' CP memory (the gathered K/V),
    as eval_plan with kernels='local' does, not TE's ring (PC43: always 'te')."""
    from megatron_ext.cost_model import Shape, padded_vocab
    from megatron_ext.eval_plan import eval_plan, eval_report

    sets = ["runtime.attention=sdpa", "parallel.sequence_parallel=false"]
    r = load_recipe(CPT_1M, sets)
    shape = Shape.from_recipe(r)
    layout = {"gpus": 64, "tensor": r.parallel.tensor, "pipeline": 1, "mfu": 0.35, "kernels": "local",
              "vocab_rows": padded_vocab(shape.vocab, r.model.make_vocab_size_divisible_by, r.parallel.tensor)}
    plans = [eval_plan(shape, resolve_gpu("h100"), n, context=4, **layout) for n in (1 << 17, 1 << 20)]
    expected = eval_report(plans, 11, 16, 0.35, shape) + "\n"
    te = [eval_plan(shape, resolve_gpu("h100"), n, context=4, **{**layout, "kernels": "te"})
          for n in (1 << 17, 1 << 20)]
    assert eval_report(te, 11, 16, 0.35, shape) + "\n" != expected  # the case tells the kernels apart
    assert _run(capsys, CPT_1M, *[f"--set={s}" for s in sets], "--eval", "128K,1M", "--gpus", "64", "--cp", "4") == (
        0, expected, "")
