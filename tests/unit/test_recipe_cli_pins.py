"""Pins of `python -m megatron_ext.recipe check` (megatron_ext.recipe_cli) from the mutation audit (round 9): the
`--fields` listing, the exit status and lines of several files, the resolved recipe printed, the recipe's own
warnings, and what a missing file list or a folder named like an override gets."""

import pytest
import yaml

from megatron_ext.recipe import load_recipe
from megatron_ext.recipe_cli import main
from tests.conftest import ROOT

TINY = "recipes/tiny/cpt.yaml"


def test_fields_lists_dotted_paths_with_doc_and_type(capsys):
    """`check --fields` exits 0 (RC3) and lists every field by its dotted path (RC1: 'trainsteps') with its
    docstring and type in words (RC2: the type left out; RS12: an integer called a number)."""
    assert main(["check", "--fields"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line in ("train.steps: Optimizer steps (required). [an integer]",
                 "checkpoint.keep_last: Keep only the newest this many iter_* folders (null: keep all). [an integer or "
                 "null]",
                 "rope.short_factor: longrope: per-frequency factors for short contexts. [a list of a number or null]"):
        assert line in lines
    assert all(line.split(":", 1)[0].count(".") == 1 for line in lines if not line.startswith("name:")), lines


def test_no_file_is_a_usage_error(capsys):
    """`check` with neither a file nor --fields is argparse's usage error, exit 2 (RC4: exit 0, nothing checked)."""
    with pytest.raises(SystemExit) as e:
        main(["check"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith("error: check: give at least one recipe file (or --fields)\n")


def test_several_bad_files(tmp_path, capsys):
    """Two bad files: one error line each, naming its file (RC18), and exit status 1, not the count (RC16)."""
    bad = [tmp_path / "a.yaml", tmp_path / "b.yaml"]
    for f in bad:
        f.write_text("train: {stepz: 1}\n")
    assert main(["check", "--quiet", *map(str, bad)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {f}: train.stepz: unknown key (did you mean 'steps'?); valid keys here: stage, seq_length, "
        "global_batch_size, micro_batch_size, steps, lr, min_lr, lr_schedule, warmup_steps, weight_decay, adam_beta1, "
        "adam_beta2, adam_eps, clip_grad, seed, precision, recompute, recompute_layers, loss_head, loss_chunk_tokens, "
        "distributed_optimizer, overlap_grad_reduce, overlap_param_gather, ddp_bucket_size, log_interval, "
        "eval_interval, eval_iters" for f in bad]


def test_the_resolved_recipe_is_printed(capsys, monkeypatch):
    """Without --quiet: a `# FILE (resolved)` header (RC17), then the recipe as YAML that loads back to the same
    recipe, on stdout; `ok: FILE` on stderr (RC10)."""
    monkeypatch.chdir(ROOT)
    assert main(["check", TINY]) == 0
    out, err = capsys.readouterr()
    header, text = out.split("\n", 1)
    assert header == f"# {TINY} (resolved)" and err == f"ok: {TINY}\n"
    assert load_recipe(raw=yaml.safe_load(text)) == load_recipe(TINY)


def test_the_recipes_own_warnings(capsys, monkeypatch):
    """A rotary fraction below 1 and selective recompute on GPUs are warned of, as `launch --check` does (RC12,
    RC13: one of them left out)."""
    monkeypatch.chdir(ROOT)
    assert main(["check", "--quiet", "--set", "runtime.device=cuda", "--set", "train.recompute=selective",
                 "--set", "rope.partial_rotary_factor=0.5", TINY]) == 0
    out, err = capsys.readouterr()
    assert out == f"ok: {TINY}\n"
    assert [line.split(": ", 2)[2].split(" ", 1)[0] for line in err.splitlines()] == \
        ["rope.partial_rotary_factor", "train.recompute"], err


def test_a_folder_named_like_an_override_is_a_folder(tmp_path, capsys):
    """A folder `steps=10` given is checked as the path it is, and said to be a folder (RC5: taken for an
    override, since it is no file)."""
    folder = tmp_path / "steps=10"
    folder.mkdir()
    assert main(["check", "--quiet", str(folder)]) == 1
    assert capsys.readouterr().err == (f"error: {folder}: recipe file {str(folder)!r} is a folder; give the path to a "
                                       ".yaml recipe (see recipes/)\n")
