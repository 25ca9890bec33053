"""`tools/niah.py` arguments (megatron_ext.evaluate.cli_args) where the CLI tests do not look: a depth range of one
point, an --out inside a Megatron checkpoint known by its iter_* folders alone (no latest pointer, or an iteration
folder reached through a link), and the defaults README.md states (mutation audit round 9). Each mistake is one
`error: ...` line before a model is loaded (the models named here are folders without weights)."""

from megatron_ext.evaluate.cli_args import parse_depths, parsers
from tests.unit.test_evaluate_cli_errors import _error


def test_a_depth_range_of_one_point():
    """START:END:STEP with START == END is allowed (the message says START <= END): that one depth."""
    assert parse_depths("50:50:10") == [50.0]
    assert parse_depths("100:100:5") == [100.0]


def test_out_inside_a_checkpoint_known_by_its_iteration_folders(tmp_path, monkeypatch):
    """A checkpoint root whose latest pointer is not written yet (iter_* folders only), and one iteration folder
    given through a link: --out inside either is refused as inside the model, as for a root with its pointer."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck" / "iter_0000005").mkdir(parents=True)
    (tmp_path / "it").symlink_to(tmp_path / "ck" / "iter_0000005")
    run = ["--lengths", "256", "--no-progress"]
    assert _error(["--megatron", "ck", "--out", "ck/niah", *run]) == (
        "error: --out ck/niah lies inside --megatron ck (the model being evaluated): write the results to a separate "
        "folder, e.g. --out runs/niah")
    assert _error(["ruler", "--megatron", "it", "--out", "it", *run]) == (
        "error: --out it is --megatron it (the model being evaluated): write the results to a separate folder, e.g. "
        "--out runs/ruler")
    assert not (tmp_path / "ck" / "niah").exists()


def test_the_defaults_are_the_library_s():
    """A sweep from the command line runs the grid the Python API (README.md) runs by default: the same samples,
    seed, answer budget, batch and prefill chunk as run_niah's and run_ruler's (README: ruler's `--samples`
    defaults to 4), and ppl's buckets per octave as perplexity_by_position's."""
    import inspect

    from megatron_ext.evaluate import perplexity_by_position, run_niah
    from megatron_ext.evaluate.ruler import run_ruler

    p = parsers()
    for command, library in (("niah", run_niah), ("ruler", run_ruler)):
        args = vars(p[command].parse_args(["--model", "m", "--out", "o"]))
        defaults = inspect.signature(library).parameters
        for flag, name in (("samples", "samples"), ("seed", "seed"), ("max_new_tokens", "max_new_tokens"),
                           ("batch_tokens", "batch_tokens"), ("chunk", "prefill_chunk")):
            assert args[flag] == defaults[name].default, (command, flag)
    assert p["ruler"].parse_args(["--model", "m", "--out", "o"]).samples == 4
    ppl = p["ppl"].parse_args(["--model", "m", "--out", "o", "--text", "t"])
    assert ppl.per_octave == inspect.signature(perplexity_by_position).parameters["per_octave"].default
