"""Pins of the evaluation jobs (megatron_ext.launch_eval: `launch --niah/--ruler`, `python -m
megatron_ext.launch_eval`) from mutation audit round 8: the command each task runs after a CPT -> SFT chain, the
resume arguments of a requeued evaluation, the length check's limit and its CLI's exit codes and streams."""

from __future__ import annotations

import pytest

from megatron_ext import launch, launch_eval
from megatron_ext.recipe import RecipeError
from tests.conftest import ROOT


def _run_lines(out: str) -> list[str]:
    """The `run per task: python tools/niah.py ...` lines of a dry run."""
    return [line.split("run per task: ", 1)[1] for line in out.splitlines() if "run per task: python tools/" in line]


def test_evaluations_after_a_cpt_sft_chain_run_the_sft_model_at_the_cpt_layout(monkeypatch, capsys, tmp_path):
    """After cpt (CP 2, 2048 tokens) -> sft (CP 1, 256 tokens): NIAH and RULER evaluate the SFT checkpoint (the last
    stage) with chat prompts, at the CPT stage's TP x CP (the longest sequences), NIAH at depths 0:100:10, each into
    `<checkpoint.dir>_<name>` (a trailing slash of checkpoint.dir dropped, not `<dir>/_niah`)."""
    monkeypatch.chdir(ROOT)
    sft_dir = f"{tmp_path}/sft/"
    assert launch.main(["--dry-run", "--recipe", "recipes/tiny", "--stages", "cpt,sft", "--niah", "1K",
                        "--ruler", "2K", f"sft:checkpoint.dir={sft_dir}"]) == 0, capsys.readouterr().err
    niah, ruler = _run_lines(capsys.readouterr().out)
    assert niah == (f"python tools/niah.py --megatron {sft_dir} --engine megatron --tp 1 --cp 2 --lengths 1K "
                    f"--depths 0:100:10 --out {tmp_path}/sft_niah --no-progress --chat")
    assert ruler == (f"python tools/niah.py ruler --megatron {sft_dir} --engine megatron --tp 1 --cp 2 --lengths 2K "
                     f"--tasks all --out {tmp_path}/sft_ruler --no-progress --chat")


def test_evaluations_after_a_cpt_stage_use_plain_prompts(monkeypatch, capsys):
    """A CPT model is not chat-tuned: no --chat after a CPT stage (its NIAH prompts are plain text); a CPU recipe's
    evaluation job asks for no GPUs."""
    monkeypatch.chdir(ROOT)
    assert launch.main(["--dry-run", "--recipe", "recipes/tiny/cpt.yaml", "--ruler", "1K"]) == 0
    out = capsys.readouterr().out
    (ruler,) = _run_lines(out)
    assert ruler.endswith("--no-progress") and "--chat" not in ruler
    # a CPU recipe's evaluation job asks Slurm for no GPUs (a job asking some would not start on a CPU partition)
    assert "sbatch gpus_per_node" not in out.split("then ruler: ")[1]


def test_a_requeued_evaluation_adds_resume_once(monkeypatch, tmp_path):
    """A requeued evaluation goes on from its saved cells with one `--resume`: submitit's checkpoint adds it once
    (not again on a second requeue), and a Slurm requeue of an evaluation that already has it adds none (a repeated
    flag would reach argparse twice, harmless there but a sign the arguments grow with every requeue)."""
    import megatron_ext.evaluate.cli as cli

    first = launch_eval.EvalStage("niah", ["--megatron", "ckpt", "--out", str(tmp_path)], "results.json")
    again = first.checkpoint().function.checkpoint().function
    assert again.argv == ["--megatron", "ckpt", "--out", str(tmp_path), "--resume"]
    assert (again.name, again.results) == ("niah", "results.json")

    seen: list[list[str]] = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(list(argv)))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    (tmp_path / "results.json").write_text('{"accuracy": 0.75}')
    assert again() == {"stage": "niah", "out": str(tmp_path), "accuracy": 0.75}
    assert seen == [["--megatron", "ckpt", "--out", str(tmp_path), "--resume"]]


def test_lengths_up_to_the_models_limit_are_allowed(monkeypatch):
    """A length equal to the last stage's max_position_embeddings (the tiny CPT's 2048) is evaluated; one token more
    is refused, naming the option, the length and the limit."""
    from megatron_ext.recipe import load_recipe

    monkeypatch.chdir(ROOT)
    cpt = load_recipe("recipes/tiny/cpt.yaml", [])
    launch_eval.check_lengths("--niah", "2048", cpt)
    with pytest.raises(RecipeError, match=r"--niah '2049': 2,049 tokens is beyond the last stage's "
                                          r"model\.max_position_embeddings = 2,048"):
        launch_eval.check_lengths("--niah", "2049", cpt)


def test_cli_help_errors_and_overrides(monkeypatch, capsys):
    """`python -m megatron_ext.launch_eval` (slurm/pipeline.sh's check): --help on stdout with status 0, too few
    arguments the usage on stderr with 2, a bad length one `error:` line on stderr with 1 that names the option
    without the evaluation CLI's own `--lengths:` prefix, and recipe overrides after the recipe applied."""
    monkeypatch.chdir(ROOT)
    assert launch_eval.main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m megatron_ext.launch_eval") and err == ""
    assert launch_eval.main(["--niah"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: ")
    assert launch_eval.main(["--ruler", "4Q"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --ruler '4Q': ") and "--lengths" not in err
    # the override raises the limit: 4096 is fine for the recipe overridden, refused without the override
    assert launch_eval.main(["--niah", "4096", "recipes/tiny/cpt.yaml", "model.max_position_embeddings=4096"]) == 0
    assert launch_eval.main(["--niah", "4096", "recipes/tiny/cpt.yaml"]) == 1
    assert "max_position_embeddings = 2,048" in capsys.readouterr().err


def test_an_evaluation_job_keeps_tp_groups_whole_per_node_at_an_odd_context(monkeypatch, capsys):
    """TP 2 x CP 3 (6 ranks) on 4-GPU nodes: 3 nodes of 2 tasks, each node one whole TP group (its all-reduce on
    NVLink), not 2 nodes of 3 tasks (what preferring multiples of CP gives: the second TP group across two nodes)."""
    monkeypatch.chdir(ROOT)
    assert launch.main(["--recipe", "recipes/cpt_1m.yaml", "--niah", "128K", "--dry-run", "cluster.gpus_per_node=4",
                        "cluster.nodes=6", "parallel.tensor=2", "parallel.context=3", "train.global_batch_size=4",
                        "train.seq_length=1044480"]) == 0, capsys.readouterr().err
    niah = capsys.readouterr().out.split("then niah: ")[1]
    assert niah.startswith("6 processes")
    assert "  sbatch nodes: 3\n" in niah and "  sbatch ntasks_per_node: 2\n" in niah
    assert "  sbatch gpus_per_node: 2\n" in niah  # one GPU per task on each node, not TP x CP = 6 of 4
