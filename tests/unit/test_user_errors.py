"""User mistakes a fuzzing pass over the tools found ending in a traceback, in a silent exit 0, or in a misleading
message (2026-12-01): each now ends in one error naming the file or flag, the value and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_ext import convert_cli, plan_cli  # tools/convert.py's and tools/plan.py's command lines
from megatron_ext.recipe import RecipeError, load_recipe
from tests.conftest import ROOT
from tests.unit.test_convert_fixtures import make_hf_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("user_errors") / "hf")


@pytest.fixture(scope="module")
def hf_with_tokenizer(tmp_path_factory) -> Path:
    from tests.unit.test_evaluate import save_tiny

    return save_tiny(tmp_path_factory.mktemp("user_errors_tok"))


def broken_copy(hf: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(hf, out)
    return out


def test_a_config_json_that_is_not_an_object(hf, tmp_path):
    """`[1, 2]` as config.json: AttributeError ('list' object has no attribute 'get') in convert and quantize, a
    TypeError from transformers in niah."""
    from megatron_ext.convert import ConvertError
    from megatron_ext.convert.hf_io import read_hf_config
    from megatron_ext.evaluate import EvalError
    from megatron_ext.evaluate.loading import load_hf
    from megatron_ext.quantize import QuantizeError
    from megatron_ext.quantize.fp8 import read_hf_config as quantize_config

    bad = broken_copy(hf, tmp_path, "list")
    (bad / "config.json").write_text("[1, 2]")
    said = rf"{bad}/config.json: a JSON list, not an object of config fields"
    for call, error in ((read_hf_config, ConvertError), (quantize_config, QuantizeError), (load_hf, EvalError)):
        with pytest.raises(error, match=said):
            call(bad)
    (bad / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConvertError, match=r"config\.json: not UTF-8 text \(byte 0\)"):
        read_hf_config(bad)


def test_weights_missing_or_cut_short(hf_with_tokenizer, tmp_path):
    """niah and quantize loaded them through transformers and ended in its OSError or SafetensorError."""
    from megatron_ext.evaluate import EvalError
    from megatron_ext.evaluate.loading import load_hf
    from megatron_ext.quantize import QuantizeError
    from megatron_ext.quantize.fp8 import load_model

    hf = hf_with_tokenizer
    load_hf(hf, device="cpu")  # the control: the folder as saved loads
    gone = broken_copy(hf, tmp_path, "gone")
    (gone / "model.safetensors").unlink()
    cut = broken_copy(hf, tmp_path, "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5000])
    for folder, why in ((gone, r"OSError: .*no file named model\.safetensors"), (cut, r"SafetensorError: ")):
        with pytest.raises(EvalError, match=rf"model directory {folder}: cannot load the model's weights \({why}"):
            load_hf(folder, device="cpu")
        with pytest.raises(QuantizeError, match=rf"--hf {folder}: cannot load the model's weights \({why}"):
            load_model(folder, device="cpu")


def test_a_recipe_that_is_not_text_and_a_world_of_no_processes(tmp_path, capsys):
    from megatron_ext import checkpoint_cli, launch

    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x00\xff\xfe")
    with pytest.raises(RecipeError, match=r"binary\.yaml' is not UTF-8 text \(byte 1\); give a \.yaml recipe"):
        load_recipe(binary)
    with pytest.raises(RecipeError, match=r"world size = 0: a run has at least 1 process; give --world-size N"):
        load_recipe(ROOT / "recipes/tiny/cpt.yaml", world_size=0)  # was ZeroDivisionError
    assert launch.main(["--check", "--recipe", str(ROOT / "recipes/tiny/cpt.yaml"), "--world-size", "-2"]) == 1
    assert "world size = -2: a run has at least 1 process" in capsys.readouterr().err  # was about profile.ranks
    assert checkpoint_cli.main(["info", str(tmp_path), "--set", "train.steps=1"]) == 1  # was ignored, exit 0
    assert capsys.readouterr().err == "error: --set and --world-size describe the run of --recipe; give --recipe FILE too\n"


def test_corrupt_indexed_data_for_perplexity_and_calibration(tmp_path, token_data):
    """`niah.py ppl --indexed` and `quantize.py --calib` opened it with Megatron-Core's reader: an AssertionError
    or ValueError, and a second traceback from its __del__."""
    from megatron_ext.evaluate import EvalError
    from megatron_ext.evaluate.perplexity import indexed_documents
    from megatron_ext.quantize import QuantizeError
    from megatron_ext.quantize.calib import load_windows

    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(token_data + suffix, tmp_path / ("c" + suffix))
    prefix = str(tmp_path / "c")
    assert len(indexed_documents(prefix)) == 120  # the control
    Path(prefix + ".idx").write_bytes(b"garbage!")
    with pytest.raises(EvalError, match=r"--indexed: data prefix .*/c: .*/c\.idx is truncated or corrupt \(8 bytes"):
        indexed_documents(prefix)
    with pytest.raises(QuantizeError, match=r"--calib: data prefix .*/c: .*/c\.idx is truncated or corrupt"):
        load_windows(prefix, samples=1, seq_length=64)


def test_convert_options_checked_before_the_work(hf, tmp_path, cpu_parallel_state, capsys):
    """to-hf --tokenizer of a folder without one wrote the model and warned (exit 0); a negative --tolerance ran
    the whole conversion to fail its own check."""
    mc = tmp_path / "mc"
    assert convert_cli.main(["to-megatron", "--hf", str(hf), "--out", str(mc), "--no-progress"]) == 0
    (tmp_path / "empty").mkdir()
    for tok, what in (("nope", " does not exist"), ("empty", r": no tokenizer files there \(tokenizer\.json, .*\)")):
        with pytest.raises(SystemExit, match=rf"^error: --tokenizer {tmp_path / tok}{what}; give the folder of the "
                                             "model's tokenizer"):
            convert_cli.main(["to-hf", "--megatron", str(mc), "--out", str(tmp_path / "o"), "--tokenizer",
                              str(tmp_path / tok)])
    with pytest.raises(SystemExit, match=r"^error: --tolerance -1\.0: the largest \|logit difference\| --verify "):
        convert_cli.main(["to-hf", "--megatron", str(mc), "--out", str(tmp_path / "o"), "--tolerance", "-1"])
    assert not (tmp_path / "o").exists()


def test_plan_refuses_what_it_used_to_drop(capsys):
    """--tp 0 planned with TP 1; two recipes planned the second."""
    for flag in ("--tp", "--pp", "--cp", "--prompts"):
        with pytest.raises(SystemExit, match=rf"^error: .*cpt\.yaml: {flag} = 0: must be >= 1$"):
            plan_cli.main(["recipes/tiny/cpt.yaml", "--gpu", "h100", "--eval", "4K", flag, "0"])
    with pytest.raises(SystemExit, match=r"^error: two recipes, a\.yaml and --recipe b\.yaml: give one$"):
        plan_cli.main(["a.yaml", "--recipe", "b.yaml"])


def test_launch_counts_and_a_folder_as_recipe(capsys, monkeypatch):
    """--nodes 0 / --cpus-per-task 0 were dropped (the recipe's values submitted); `--recipe FOLDER --stages`, as
    its help says, looked in the folder's parent."""
    from megatron_ext import launch

    monkeypatch.chdir(ROOT)
    for flag in ("--nodes", "--cpus-per-task", "--tasks-per-node"):
        with pytest.raises(SystemExit) as exit_:
            launch.main(["--dry-run", "--recipe", "recipes/tiny/cpt.yaml", flag, "0"])
        assert exit_.value.code == 2 and f"argument {flag}: 0: must be >= 1" in capsys.readouterr().err
    assert launch.main(["--dry-run", "--recipe", "recipes/tiny", "--stages", "cpt,sft"]) == 0
    assert "stage 2/2 sft: recipes/tiny/sft.yaml" in capsys.readouterr().out


def test_init_from_whose_pointer_is_garbage(tmp_path, token_data):
    """The preflight said ok; the run failed after building the model."""
    from megatron_ext.checkpoint_layout import available_iterations
    from megatron_ext.train_setup import check_setup

    root = tmp_path / "ckpt"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("abc\n")
    run = ["parallel.context=1", "train.seq_length=256", "train.global_batch_size=2", f"data.prefix={token_data}",
           f"checkpoint.dir={tmp_path / 'run'}", f"checkpoint.init_from={root}"]
    with pytest.raises(RecipeError, match=r"checkpoint\.init_from = '.*ckpt': .*latest_checkpointed_iteration\.txt: "
                                          r"expected an iteration number, found 'abc'"):
        check_setup(load_recipe(ROOT / "recipes/tiny/cpt.yaml", run, world_size=1))
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")
    with pytest.raises(RecipeError, match=r"has no iteration 3 \(iter_0000003\); available: \[2\]"):
        check_setup(load_recipe(ROOT / "recipes/tiny/cpt.yaml", run, world_size=1))
    (root / ".iter_0000003.old").mkdir()  # a save of iteration 3 again, stopped between its two renames
    with pytest.raises(RecipeError, match=r"available: \[2\]; \.iter_0000003\.old holds it from a save of iteration 3 "
                                          r"again that was stopped: rename it to iter_0000003"):
        check_setup(load_recipe(ROOT / "recipes/tiny/cpt.yaml", run, world_size=1))
    (root / ".iter_0000003.old").rmdir()
    (root / "iter_0000003").write_text("a file, not a save")
    assert available_iterations(root) == [2]  # was [2, 3]: "no iteration 3 ... available: [2, 3]"


def test_a_tokenizer_path_that_is_not_there(tmp_path, token_data, toy_tokenizer):
    """The checkpoint records model.tokenizer for the export and the evaluation; a path that is not there passed
    the preflight. A hub name cannot be checked offline and passes."""
    from megatron_ext.train_setup import check_setup

    run = ["parallel.context=1", "train.seq_length=256", "train.global_batch_size=2", f"data.prefix={token_data}",
           f"checkpoint.dir={tmp_path / 'run'}"]
    for tok in (toy_tokenizer, "meta-llama/Llama-3.1-8B-Instruct"):
        check_setup(load_recipe(ROOT / "recipes/tiny/cpt.yaml", [*run, f"model.tokenizer={tok}"], world_size=1))
    with pytest.raises(RecipeError, match=rf"model\.tokenizer = '{tmp_path}/nope': no such folder"):
        check_setup(load_recipe(ROOT / "recipes/tiny/cpt.yaml", [*run, f"model.tokenizer={tmp_path}/nope"],
                                world_size=1))


def test_niah_of_a_bad_megatron_checkpoint_leaves_no_folder(tmp_path):
    """It said 'converting ... failed: error: ...' and left the empty --out it had made for the conversion."""
    from megatron_ext.evaluate.cli import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("abc\n")
    with pytest.raises(SystemExit) as exit_:
        main(["--megatron", str(ckpt), "--out", str(tmp_path / "out"), "--device", "cpu", "--lengths", "128"])
    said = str(exit_.value.code)
    assert said.startswith(f"error: --megatron {ckpt}: {ckpt}/latest_checkpointed_iteration.txt: "
                           "expected an iteration number"), said  # before converting, which would fail alike
    assert "convert it first" not in said, said
    assert not (tmp_path / "out").exists()


def test_a_file_where_a_folder_belongs_and_the_other_way(tmp_path, capsys):
    """Both were reported as 'does not exist' although the path is there."""
    from megatron_ext.convert import ConvertError
    from megatron_ext.convert.hf_io import read_hf_config
    from megatron_ext.evaluate import EvalError
    from megatron_ext.evaluate.cli import main
    from megatron_ext.evaluate.loading import load_hf

    a_file, a_folder = tmp_path / "file.txt", tmp_path / "folder"
    a_file.write_text("x")
    a_folder.mkdir()
    with pytest.raises(ConvertError, match=rf"--hf {a_file}: is a file, not a folder; give a Hugging Face model"):
        read_hf_config(a_file)
    with pytest.raises(EvalError, match=rf"model directory {a_file} is a file, not a folder"):
        load_hf(a_file)
    for flag in ("--haystack", "--document"):
        args = (["generate", "--question", "q"] if flag == "--document" else []) + \
            ["--model", str(tmp_path), "--out", str(tmp_path / "o"), flag, str(a_folder)]
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert str(exit_.value.code).startswith(f"error: {flag} {a_folder} is a folder, not a file: give a UTF-8 "), \
            exit_.value.code


def test_engine_parallel_sizes_below_one(capsys):
    """--tp 0 said '--tp 0 x --pp 1 x --cp 1 must divide the 1 processes'."""
    from megatron_ext.evaluate.cli import main

    for flag in ("--tp", "--pp", "--cp"):
        with pytest.raises(SystemExit) as exit_:
            main(["--megatron", "ckpt", "--engine", "megatron", flag, "0", "--out", "o"])
        assert exit_.value.code == f"error: {flag} 0: must be >= 1 (a parallel size of the Megatron engine)"



def test_model_sizes_below_one_and_an_override_given_as_a_file(capsys):
    """model.vocab_size=-1 and model.num_hidden_layers=0 passed the recipe check (the first failed later as 'rows
    for ids 0..-2'); `recipe check FILE key=value` looked for a recipe file named key=value."""
    from megatron_ext.recipe_cli import main

    tiny = str(ROOT / "recipes/tiny/cpt.yaml")
    for override, said in (("model.vocab_size=-1", "model.vocab_size = -1: must be >= 1"),
                           ("model.num_hidden_layers=0", "model.num_hidden_layers = 0: must be >= 1"),
                           ("model.rms_norm_eps=0", "model.rms_norm_eps = 0.0: must be > 0")):
        with pytest.raises(RecipeError, match=said):
            load_recipe(tiny, [override])
    assert main(["check", "--quiet", tiny, "model.vocab_size=5"]) == 1
    assert capsys.readouterr().err == ("error: model.vocab_size=5: not a recipe file but an override, it seems; give "
                                       "overrides with --set model.vocab_size=5\n")


def test_tokenizer_or_data_beyond_the_models_vocabulary(tmp_path, token_data, toy_tokenizer, capsys):
    """A tokenizer (or data) with ids the model has no embedding row for: the trainer accepted such a
    model.tokenizer and recorded it, the export shipped it, and niah.py / ppl --indexed ended in a bare IndexError
    from the embedding. Control: the model's own vocabulary size passes."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext import launch
    from megatron_ext.evaluate import EvalError
    from megatron_ext.evaluate.cli import main as niah
    from megatron_ext.evaluate.perplexity import indexed_documents

    # trainer / launch --check: the toy tokenizer makes ids up to 511
    run = ["--check", "--recipe", str(ROOT / "recipes/tiny/cpt.yaml"), "--world-size", "2",
           f"data.prefix={token_data}", f"checkpoint.dir={tmp_path / 'run'}", f"model.tokenizer={toy_tokenizer}"]
    assert launch.main(run) == 0
    assert launch.main([*run, "model.vocab_size=300"]) == 1
    assert (f"model.tokenizer = '{toy_tokenizer}' makes token ids up to 511, but model.vocab_size = 300"
            in capsys.readouterr().err)

    # niah with the tokenizer saved beside the model
    small = make_hf_model(tmp_path / "hf", tokenizer=False, vocab_size=300)
    for f in Path(toy_tokenizer).iterdir():
        shutil.copy(f, small / f.name)
    with pytest.raises(SystemExit, match=rf"^error: the tokenizer in {small} has 512 tokens but the model's "
                                         "vocab_size is 300"):
        niah(["--model", str(small), "--lengths", "256", "--depths", "50", "--device", "cpu",
              "--out", str(tmp_path / "n")])

    # ppl --indexed: the longest documents first (the oracle: Megatron-Core's reader, sorted in Python), and ids
    # beyond the model's rows named
    ds = IndexedDataset(token_data)
    bounds = ds.document_indices
    lengths = [int(ds.sequence_lengths[bounds[i]:bounds[i + 1]].sum()) for i in range(len(bounds) - 1)]
    want = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[:5]
    docs = indexed_documents(token_data, 5, vocab_size=512)
    assert [len(d) for d in docs] == [lengths[i] for i in want]
    np.testing.assert_array_equal(docs[0], np.concatenate([ds[j] for j in range(bounds[want[0]],
                                                                                 bounds[want[0] + 1])]))
    largest = max(int(d.max()) for d in docs)
    with pytest.raises(EvalError, match=rf"--indexed {token_data}: token ids up to {largest}, but the model's "
                                        rf"vocab_size is {largest} \(ids 0..{largest - 1}\): the data was tokenized"):
        indexed_documents(token_data, 5, vocab_size=largest)
