"""Bad input to tools/convert.py: one clear `error: ...` line, non-zero exit, nothing half-written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext import convert_cli as cli  # tools/convert.py's command line
from tests.conftest import ROOT
from tests.unit.test_convert_fixtures import make_hf_model


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("src") / "hf")


@pytest.fixture(scope="module")
def mcore(src, tmp_path_factory, cpu_parallel_state):
    out = tmp_path_factory.mktemp("mc") / "mcore"
    assert cli.main(["to-megatron", "--hf", str(src), "--out", str(out), "--no-progress"]) == 0
    return out


def fails(args: list[str], *fragments: str) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def no_leftovers(parent, name):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def copy_src(src, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(src, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_hf_dir(tmp_path, cpu_parallel_state):
    fails(["to-megatron", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist")
    (tmp_path / "empty").mkdir()
    fails(["to-megatron", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], "no config.json")
    no_leftovers(tmp_path, "o")


@pytest.mark.parametrize("changes, fragment", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "only LlamaForCausalLM"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_type='mrope' is not supported"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),  # named, not as tensors with no place (audit round 5)
    ({"intermediate_size": 200}, "mlp.gate_proj.weight has shape [176, 64] but config.json implies [200, 64]"),
    ({"num_hidden_layers": 1}, "no place in a Llama model"),
    ({"num_hidden_layers": 3}, "tensors missing"),
])
def test_bad_config(src, tmp_path, cpu_parallel_state, changes, fragment):
    d = copy_src(src, tmp_path)
    edit_config(d, **changes)
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], fragment)
    no_leftovers(tmp_path, "o")


def test_index_names_missing_shard(src, tmp_path, cpu_parallel_state):
    d = copy_src(src, tmp_path)
    names = json.loads(json.dumps(list(__import__("safetensors").safe_open(str(d / "model.safetensors"), "pt").keys())))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: ("model-00002-of-00002.safetensors" if "layers.1." in n else "model.safetensors")
                        for n in names}}))
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], "model-00002-of-00002.safetensors",
          "does not exist")
    no_leftovers(tmp_path, "o")


def test_a_tensor_in_two_files_without_an_index(src, tmp_path, cpu_parallel_state):
    """A stray safetensors file beside the model's (another save) holding one of its tensors: the alphabetically
    last copy was taken silently; now refused, naming both files. With an index, the index decides."""
    from safetensors.torch import load_file, save_file

    d = copy_src(src, tmp_path)
    norm = "model.norm.weight"
    save_file({norm: load_file(str(d / "model.safetensors"))[norm] * 2}, str(d / "zz-old.safetensors"))
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")],
          f"tensor {norm} is in both model.safetensors and zz-old.safetensors")
    no_leftovers(tmp_path, "o")
    from megatron_ext.convert.hf_io import SafetensorsReader

    names = list(load_file(str(d / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map["extra.weight"] = "zz-old.safetensors"  # the index names the stray file too, for another tensor
    save_file({norm: load_file(str(d / "model.safetensors"))[norm] * 2, "extra.weight": torch.zeros(1)},
              str(d / "zz-old.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert SafetensorsReader(d).file_of[norm] == "model.safetensors"


def test_corrupt_shard(src, tmp_path, cpu_parallel_state):
    d = copy_src(src, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], "model.safetensors", "re-download")
    no_leftovers(tmp_path, "o")


def test_missing_lm_head_when_untied(src, tmp_path, cpu_parallel_state):
    from safetensors.torch import load_file, save_file

    d = copy_src(src, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], "lm_head.weight is required")


def test_tied_config_with_a_different_lm_head(src, tmp_path, cpu_parallel_state):
    """tie_word_embeddings true beside a stored lm_head.weight of its own: transformers would ignore that lm_head and
    compute other logits than the weights say, so the import refuses it; an lm_head equal to the embedding is the
    same model and converts."""
    from safetensors.torch import load_file, save_file

    d = copy_src(src, tmp_path)
    edit_config(d, tie_word_embeddings=True)  # the untied fixture's random lm_head differs from its embedding
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], "tie_word_embeddings is true",
          "lm_head.weight differs from model.embed_tokens.weight", "set tie_word_embeddings=false")
    no_leftovers(tmp_path, "o")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert cli.main(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o"), "--no-progress"]) == 0


def test_output_exists_needs_force(src, mcore, tmp_path, cpu_parallel_state):
    out = tmp_path / "o"
    out.mkdir()
    fails(["to-megatron", "--hf", str(src), "--out", str(out)], "already exists (an empty folder)", "--force")
    fails(["to-hf", "--megatron", str(mcore), "--out", str(out)], "already exists")
    assert cli.main(["to-hf", "--megatron", str(mcore), "--out", str(out), "--force", "--no-progress"]) == 0
    assert (out / "config.json").is_file()
    (out / "config.json").write_text("{}")  # an earlier export: replaced by the new one
    fails(["to-hf", "--megatron", str(mcore), "--out", str(out)], "already exists (a Hugging Face model folder)")
    assert cli.main(["to-hf", "--megatron", str(mcore), "--out", str(out), "--force", "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def _tree(folder):
    return sorted((str(p.relative_to(folder)), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


def test_force_replaces_only_a_previous_conversion(src, mcore, tmp_path, cpu_parallel_state):
    """--force deleted whatever folder --out named (notes, a data set, a sub-folder): now only an earlier output of
    the same command, or an empty folder, is replaced."""
    out = tmp_path / "work"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "sub/data.bin").write_bytes(b"data")
    (out / "config.json").write_text("{}")  # beside HF-looking files, other files still make it no export
    (out / "model.safetensors").write_bytes(b"x")
    before = _tree(out)
    for argv in (["to-megatron", "--hf", str(src)], ["to-hf", "--megatron", str(mcore)]):
        fails([*argv, "--out", str(out), "--force"], f"--out {out} holds notes.txt, sub/ (not a checkpoint); "
              "--force replaces only a previous conversion; give a new --out")
        fails([*argv, "--out", str(out)], "holds notes.txt, sub/")
    assert _tree(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".work.")]
    # a previous output of the other direction is not replaced either
    hf_out, mc_out = tmp_path / "hf_out", tmp_path / "mc_out"
    shutil.copytree(src, hf_out)
    shutil.copytree(mcore, mc_out)
    fails(["to-megatron", "--hf", str(src), "--out", str(hf_out), "--force"], "is a Hugging Face model folder, not a "
          "Megatron checkpoint", "not one of to-hf")
    fails(["to-hf", "--megatron", str(mcore), "--out", str(mc_out), "--force"], "is a Megatron checkpoint, not a "
          "Hugging Face model folder", "not one of to-megatron")
    # the same direction's is: a Megatron root replaced by to-megatron, an HF folder by to-hf
    (mc_out / "iter_0000007").mkdir()
    (mc_out / ".iter_0000008.partial").mkdir()  # a save interrupted there (checkpoint.py's staging name)
    assert cli.main(["to-megatron", "--hf", str(src), "--out", str(mc_out), "--force", "--no-progress"]) == 0
    assert sorted(p.name for p in mc_out.iterdir()) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert cli.main(["to-hf", "--megatron", str(mcore), "--out", str(hf_out), "--force", "--no-progress"]) == 0
    assert not (hf_out / "model.safetensors").exists() and (hf_out / "model.safetensors.index.json").is_file()


def test_megatron_dir_without_latest(tmp_path, mcore, cpu_parallel_state):
    d = tmp_path / "m"
    shutil.copytree(mcore, d)
    (d / "latest_checkpointed_iteration.txt").unlink()
    fails(["to-hf", "--megatron", str(d), "--out", str(tmp_path / "o")], "latest_checkpointed_iteration.txt",
          "found iterations: [0]")
    fails(["to-hf", "--megatron", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist")
    no_leftovers(tmp_path, "o")


def test_iteration_that_does_not_exist(tmp_path, mcore, cpu_parallel_state):
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--iteration", "7"],
          "no iteration 7", "available: [0]")
    no_leftovers(tmp_path, "o")


def test_iteration_must_be_a_step_number(tmp_path, mcore, cpu_parallel_state):
    msg = fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--iteration", "-1"],
                "--iteration -1: an iteration is a training step number >= 0")
    assert "iter_-" not in msg
    no_leftovers(tmp_path, "o")


def test_tokenizer_file_instead_of_its_folder(tmp_path, mcore, src, cpu_parallel_state):
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--tokenizer",
           str(src / "tokenizer_config.json")], f"--tokenizer {src / 'tokenizer_config.json'} is a file; give its "
          f"folder: --tokenizer {src}")
    no_leftovers(tmp_path, "o")


def test_tokenizer_folder_that_does_not_exist(tmp_path, mcore, cpu_parallel_state):
    """A mistyped --tokenizer was called a folder with 'no tokenizer files there'. Control (old code): that line."""
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "nope")],
          f"--tokenizer {tmp_path / 'nope'} does not exist; give the folder of the model's tokenizer")
    no_leftovers(tmp_path, "o")


def test_a_damaged_shard_is_named(tmp_path, mcore, cpu_parallel_state):
    """A shard of the right size whose bytes are damaged (a bad copy) passes the size check; to-hf then ended in a
    55-line traceback (UnpicklingError from inside torch). Now one line naming the file. Control (old code): the
    traceback."""
    from tests.unit.test_checkpoint import zero_after

    damaged = tmp_path / "mc"
    shutil.copytree(mcore, damaged)
    shard = sorted(damaged.glob("iter_*/*.distcp"))[-1]
    zero_after(shard)
    fails(["to-hf", "--megatron", str(damaged), "--out", str(tmp_path / "o"), "--no-progress"],
          f"error: {shard}: cannot read its tensors (corrupt shard: ", "File is not a zip file",
          "; copy the checkpoint again or use an earlier iteration")
    no_leftovers(tmp_path, "o")


def test_metadata_vocab_size_above_the_embedding_rows(tmp_path, mcore, cpu_parallel_state):
    """Metadata that says vocab_size 600 beside a 512-row embedding (metadata of another model): the export would
    write 512 rows under a config of 600, which transformers cannot load. One line naming the key and the sizes."""
    d = tmp_path / "m"
    shutil.copytree(mcore, d)
    meta_file = d / "iter_0000000/megatron_ext.json"
    meta = json.loads(meta_file.read_text())
    meta["hf_config"]["vocab_size"] = 600
    meta_file.write_text(json.dumps(meta))
    fails(["to-hf", "--megatron", str(d), "--out", str(tmp_path / "o"), "--no-progress"],
          "embedding.word_embeddings.weight has shape [512, 64]", "vocab_size 600",
          "the metadata does not describe these weights")
    no_leftovers(tmp_path, "o")


def test_the_other_direction_is_suggested(tmp_path, mcore, src, cpu_parallel_state):
    fails(["to-megatron", "--hf", str(mcore), "--out", str(tmp_path / "o")],
          f"--hf {mcore} is a Megatron checkpoint", f"tools/convert.py to-hf --megatron {mcore}")
    fails(["to-megatron", "--hf", str(mcore / "iter_0000000"), "--out", str(tmp_path / "o")], "to-hf --megatron")
    fails(["to-hf", "--megatron", str(src), "--out", str(tmp_path / "o")],
          f"--megatron {src} is a Hugging Face model folder", f"tools/convert.py to-megatron --hf {src}")
    no_leftovers(tmp_path, "o")


def test_rope_preset_other_than_the_trained_rope(tmp_path, mcore, cpu_parallel_state):
    """The tiny checkpoint was trained with llama3 rope: an UltraLong preset declared a rope its weights never saw,
    with only a warning (and --verify failed as a "logit diff"). It is refused unless opted in; then --verify checks
    the weights under the exported rope."""
    msg = fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--rope-preset", "ultralong-1m",
                 "--verify"], "--rope-preset ultralong-1m: its rope {'rope_type': 'yarn', 'factor': 128.0",
                "differs from the rope", "{'rope_type': 'llama3'", "--rope-preset-differs-ok")
    assert "logit diff" not in msg
    no_leftovers(tmp_path, "o")
    assert cli.main(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--rope-preset", "ultralong-1m",
                     "--rope-preset-differs-ok", "--verify", "--no-progress"]) == 0
    cfg = json.loads((tmp_path / "o/config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["max_position_embeddings"] == 2**20


def test_rope_preset_and_max_positions_exclusive(tmp_path, mcore, cpu_parallel_state):
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--rope-preset", "ultralong-1m",
           "--max-position-embeddings", "5"], "either --rope-preset or --max-position-embeddings")


def test_cli_process_exits_with_one_line(tmp_path):
    """The real command: exit status 1 and a single `error:` line on stderr, no traceback."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "tools/convert.py"), "to-hf", "--megatron", str(tmp_path / "x"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert lines == [f"error: checkpoint directory {tmp_path / 'x'} does not exist; check the path"], proc.stderr


def test_crafted_checkpoint_index_is_not_unpickled(tmp_path, mcore, cpu_parallel_state):
    """torch_dist's `.metadata` is a pickle; the exporter reads it with an allow-list, so code never runs."""
    import os
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    d = tmp_path / "m"
    shutil.copytree(mcore, d)
    (d / "iter_0000000/.metadata").write_bytes(pickle.dumps(Exploit()))
    fails(["to-hf", "--megatron", str(d), "--out", str(tmp_path / "o")], "refusing to load posix.system")
    assert not (tmp_path / "pwned").exists()
    no_leftovers(tmp_path, "o")


def test_partially_copied_checkpoint_is_named(tmp_path, mcore, cpu_parallel_state):
    """A shard cut short (an interrupted copy from the cluster) is named before any tensor is read."""
    d = tmp_path / "m"
    shutil.copytree(mcore, d)
    shard = sorted((d / "iter_0000000").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    fails(["to-hf", "--megatron", str(d), "--out", str(tmp_path / "o")], "incomplete checkpoint",
          f"{shard.name} has 10 bytes")
    no_leftovers(tmp_path, "o")


# ---- rope blocks the project's validator (megatron_ext.rope_spec) refuses --------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("changes, fragment", [
    # transformers-5 block says llama3, transformers-4 block says linear: which one a reader uses differs
    ({"rope_parameters": LLAMA3, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling and rope_parameters disagree on ['factor', 'rope_type']"),
    ({"rope_parameters": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}}, "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 32, "rope_theta": 1e4}},
     "rope_parameters.factor: missing"),
    ({"vocab_size": "512"}, "vocab_size = '512': must be a positive integer"),
    # fields transformers and our model read differently, or that neither can use (were tracebacks, or converted
    # to a model that only --verify, if given, found different)
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5: transformers' Llama rotates every dimension"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor = 0.5"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads = '2': must be a positive integer (or absent)"),
    ({"num_key_value_heads": 0}, "num_key_value_heads = 0: must be a positive integer"),
    ({"head_dim": "16"}, "head_dim = '16': must be a positive integer"),
    ({"rms_norm_eps": None}, "rms_norm_eps = None: must be a positive number"),
    ({"tie_word_embeddings": None}, "tie_word_embeddings = None: must be true or false"),
])
def test_bad_rope_or_sizes_refused(src, tmp_path, cpu_parallel_state, changes, fragment):
    d = copy_src(src, tmp_path)
    edit_config(d, **changes)
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], str(d / "config.json"), fragment)
    no_leftovers(tmp_path, "o")


def test_config_without_hidden_size(src, tmp_path, cpu_parallel_state):
    d = copy_src(src, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], str(d / "config.json"),
          "hidden_size is missing")


# ---- flag values and output paths ---------------------------------------------------------------

@pytest.mark.parametrize("value", ["-5", "0"])
def test_vocab_divisor_must_be_positive(src, tmp_path, cpu_parallel_state, value):
    fails(["to-megatron", "--hf", str(src), "--out", str(tmp_path / "o"), "--make-vocab-size-divisible-by", value],
          f"--make-vocab-size-divisible-by {value}: must be a positive integer")
    no_leftovers(tmp_path, "o")


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_max_shard_size_must_be_positive(mcore, tmp_path, cpu_parallel_state, value):
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), f"--max-shard-size-gb={value}"],
          "--max-shard-size-gb", "must be a positive number")
    no_leftovers(tmp_path, "o")


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_position_embeddings_must_be_positive(mcore, tmp_path, cpu_parallel_state, value):
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), f"--max-position-embeddings={value}"],
          f"--max-position-embeddings {value}: must be a positive integer")
    no_leftovers(tmp_path, "o")


def test_max_position_embeddings_below_original_length(mcore, tmp_path, cpu_parallel_state):
    """llama3 rope with original_max_position_embeddings 32: declaring 16 positions is not a valid config."""
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--max-position-embeddings", "16"],
          "--max-position-embeddings 16: the exported config.json would be invalid",
          "original_max_position_embeddings = 32: above max_position_embeddings = 16")
    no_leftovers(tmp_path, "o")


def test_out_under_a_file_or_unwritable(src, mcore, tmp_path, cpu_parallel_state):
    (tmp_path / "afile").write_text("x")
    for out in ("afile/sub", "afile/sub/deeper"):  # said 'cannot create a folder there (File exists: .../afile)'
        fails(["to-megatron", "--hf", str(src), "--out", str(tmp_path / out)],
              f"--out {tmp_path / out}: {tmp_path / 'afile'} is a file, not a folder; choose another path")
        fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / out)], f"{tmp_path / 'afile'} is a file")
    fails(["to-megatron", "--hf", str(src), "--out", "/proc/x"], "--out /proc/x", "cannot create a folder there")
    fails(["to-megatron", "--hf", str(src), "--out", str(tmp_path / "afile"), "--force"], "is a file, not a folder")
    assert (tmp_path / "afile").read_text() == "x"


def test_out_overlapping_the_source_is_refused(src, mcore, tmp_path, cpu_parallel_state):
    before = sorted(p.relative_to(mcore) for p in mcore.rglob("*"))
    for out in (mcore, mcore / "hf", mcore.parent):
        fails(["to-hf", "--megatron", str(mcore), "--out", str(out), "--force"], f"overlaps --megatron {mcore}")
    assert sorted(p.relative_to(mcore) for p in mcore.rglob("*")) == before
    fails(["to-megatron", "--hf", str(src), "--out", str(src), "--force"], f"overlaps --hf {src}")
    assert (src / "config.json").is_file() and (src / "model.safetensors").is_file()


def test_tokenizer_folder_alone_gives_the_special_token_ids(tmp_path):
    """`to-hf --tokenizer DIR` with DIR a tokenizer folder (no model config.json, as the README's tiny path has):
    bos/eos/pad ids come from the tokens its tokenizer_config.json names (the export warned that generate() would
    not stop, eos unknown); a model folder's config.json still comes first."""
    from transformers import AutoTokenizer

    from megatron_ext.convert.hf_io import folder_generation_defaults
    from megatron_ext.data.toy import build_toy_tokenizer

    tok_dir = build_toy_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    gen, ids = folder_generation_defaults(tok_dir)
    assert gen is None and ids == {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                                   "pad_token_id": tok.pad_token_id}
    assert ids["eos_token_id"] == tok.convert_tokens_to_ids("<|eot_id|>")
    (tok_dir / "config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert folder_generation_defaults(tok_dir)[1] == {"eos_token_id": [7, 9]}


def test_out_a_dangling_symlink_is_refused_before_the_work(src, mcore, tmp_path, cpu_parallel_state):
    """A --out that is a symlink to nothing passed the check (exists() is False for it): the whole conversion ran,
    the rename onto the link failed, and the line said the output was removed while the model-sized staging folder
    stayed. Now refused first. Control (old code): 'error: Not a directory (.../.link.partial-...)', folder left."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere" / "zz")
    for argv in (["to-megatron", "--hf", str(src)], ["to-hf", "--megatron", str(mcore)]):
        fails([*argv, "--out", str(link), "--no-progress"], f"error: --out {link} is a symlink to "
              f"{tmp_path / 'nowhere' / 'zz'}, which does not exist; create that folder (mkdir -p "
              f"{tmp_path / 'nowhere' / 'zz'}) or give another --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_a_failed_final_rename_removes_the_staged_output(tmp_path):
    """The rename of the finished output onto --out ran outside the cleanup: when it failed (here: a dangling
    symlink put at --out meanwhile, a real ENOTDIR) the model-sized staging folder stayed. Control (old code): a
    bare OSError and the folder left."""
    from megatron_ext.convert.hf_io import ConvertError
    from megatron_ext.convert.staging import staged_output

    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=rf"^--out {out}: cannot move the finished output into place \(Not a "
                                           r"directory: .*\); it was removed and --out left as it was"):
        with staged_output(out, False, "hf") as tmp:
            (tmp / "config.json").write_text("{}")
            out.symlink_to(tmp_path / "gone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and out.is_symlink()


def test_out_a_symlink_to_a_folder_writes_that_folder(src, mcore, tmp_path, cpu_parallel_state):
    """--out a symlink to a folder (on a bigger disk, say), with --force: the link was replaced by a real folder on
    the link's file system, the target stayed empty and a `.link.old-PID` symlink was left. Now the output goes into
    the target, staged beside it, and the link stays. Control (old code): outlink a folder, realout empty, the
    .old link left."""
    big, links = tmp_path / "big", tmp_path / "links"
    (big / "realout").mkdir(parents=True)
    links.mkdir()
    link = links / "outlink"
    link.symlink_to("../big/realout")  # relative, as `ln -s` makes them
    fails(["to-hf", "--megatron", str(mcore), "--out", str(link)], f"--out {link} already exists (an empty folder)")
    for _ in range(2):  # the second replaces the first export
        assert cli.main(["to-hf", "--megatron", str(mcore), "--out", str(link), "--force", "--no-progress"]) == 0
        assert link.is_symlink() and (big / "realout" / "config.json").is_file()
        assert [p.name for p in links.iterdir()] == ["outlink"] and [p.name for p in big.iterdir()] == ["realout"]
    fails(["to-megatron", "--hf", str(src), "--out", str(link), "--force"], "is a Hugging Face model folder")
    (big / "mc").mkdir()
    link.unlink()
    link.symlink_to(big / "mc")
    assert cli.main(["to-megatron", "--hf", str(src), "--out", str(link), "--force", "--no-progress"]) == 0
    assert (big / "mc" / "latest_checkpointed_iteration.txt").is_file() and link.is_symlink()
    assert [p.name for p in links.iterdir()] == ["outlink"] and sorted(p.name for p in big.iterdir()) == ["mc",
                                                                                                           "realout"]


def test_tokenizer_folder_without_a_tokenizer(tmp_path, mcore, toy_tokenizer, cpu_parallel_state):
    """to-hf --tokenizer of a folder with tokenizer_config.json but no tokenizer.json exported (exit 0) a model no
    tokenizer loads from, the only sign a warning to 'pass --tokenizer'. Now refused before the work, as is a
    tokenizer.json transformers cannot read. Control (old code): exit 0 for both."""
    bad = tmp_path / "badtok"
    shutil.copytree(toy_tokenizer, bad)
    (bad / "tokenizer.json").unlink()
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--tokenizer", str(bad)],
          f"error: --tokenizer {bad}: no tokenizer.json (or sentencepiece tokenizer.model) there, only "
          "tokenizer_config.json, ", "give the folder of the model's tokenizer, or leave --tokenizer out")
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {')  # cut short
    fails(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--tokenizer", str(bad)],
          f"error: --tokenizer {bad}: transformers cannot load the tokenizer there (")
    no_leftovers(tmp_path, "o")
    assert cli.main(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "o"), "--tokenizer", toy_tokenizer,
                     "--no-progress"]) == 0
    assert (tmp_path / "o" / "tokenizer.json").read_bytes() == (Path(toy_tokenizer) / "tokenizer.json").read_bytes()


def test_recorded_tokenizer_without_a_vocabulary_is_not_copied(src, tmp_path, cpu_parallel_state, capsys):
    """to-hf without --tokenizer copies the tokenizer folder recorded at import, which is not checked before the work
    as --tokenizer is: one with tokenizer_config.json but no tokenizer.json was copied, and the export said it had a
    tokenizer (`tokenizer_files` in the report, no warning), one that no tokenizer loads from. Now nothing is copied
    and the warning names the folder and what it lacks. Control (old code): tokenizer_config.json copied, no warning."""
    from megatron_ext.checkpoint_layout import read_metadata

    hf = copy_src(src, tmp_path)
    (hf / "tokenizer.json").unlink()
    assert cli.main(["to-megatron", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--no-progress"]) == 0
    assert read_metadata(tmp_path / "mc")["tokenizer"] == str(hf.resolve())  # recorded: it has tokenizer files
    capsys.readouterr()
    assert cli.main(["to-hf", "--megatron", str(tmp_path / "mc"), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert not (tmp_path / "o" / "tokenizer_config.json").exists()
    assert json.loads(out)["tokenizer_files"] == []
    assert (f"warning: no tokenizer files copied ({hf.resolve()} has tokenizer_config.json but no tokenizer.json or "
            "tokenizer.model, the vocabulary); pass --tokenizer DIR to include them") in err, err


def test_a_dangling_safetensors_link_is_named(src, tmp_path, cpu_parallel_state):
    """A hub cache whose blobs were pruned: model.safetensors a symlink to nothing, no index. The line named
    model.safetensors.index.json, which does not exist. Now the link and its target. Control (old code): the index."""
    d = tmp_path / "snapshot"
    d.mkdir()
    shutil.copy(src / "config.json", d)
    blob = tmp_path / "blobs" / "0123abcd"
    (d / "model.safetensors").symlink_to(blob)
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], f"error: --hf {d}: model.safetensors is a "
          f"symlink to {blob}, which does not exist; download the model again")
    blob.mkdir(parents=True)
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], f"symlink to {blob}, which is not a file")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")],
          f"error: --hf {d}: model.safetensors is not a file; move it out of the model folder")
    no_leftovers(tmp_path, "o")


def test_what_appears_at_out_while_converting_is_not_deleted(tmp_path):
    """--out checked only before the work: what appeared there meanwhile (the user's files, another command's
    output) was moved aside and deleted by the final rename, without --force. Now it is checked again and left;
    the finished output is kept beside it under a visible name. Control (old code): notes.txt deleted, exit ok."""
    from megatron_ext.convert.hf_io import ConvertError
    from megatron_ext.convert.staging import staged_output

    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=rf"^--out {out} changed while converting and was left as it is \(--out "
                                           rf"{out} holds notes.txt \(not a checkpoint\).*\); the finished output "
                                           rf"is kept at {tmp_path}/out.converted-\d+: move it"):
        with staged_output(out, True, "hf") as tmp:
            (tmp / "config.json").write_text("{}")
            out.mkdir()
            (out / "notes.txt").write_text("mine")
    assert (out / "notes.txt").read_text() == "mine"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("out.converted-")]
    assert len(kept) == 1 and (kept[0] / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", kept[0].name])
    with pytest.raises(ConvertError, match=r"changed while converting .*already exists \(an empty folder\)"):
        with staged_output(tmp_path / "b", False, "hf") as tmp:
            (tmp_path / "b").mkdir()
    with staged_output(tmp_path / "c", True, "hf") as tmp:  # --force over an empty folder made meanwhile: fine
        (tmp / "config.json").write_text("{}")
        (tmp_path / "c").mkdir()
    assert (tmp_path / "c" / "config.json").is_file()


def test_a_dangling_config_json_link_is_named(src, tmp_path, cpu_parallel_state):
    """A hub cache whose blobs were pruned: config.json a symlink to nothing. The line said 'no config.json', as for
    a folder without one. Now the link and its target, as for a safetensors link. Control (old hf_io.py): 'no
    config.json'."""
    d = tmp_path / "snapshot"
    d.mkdir()
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    blob = tmp_path / "blobs" / "4567cdef"
    (d / "config.json").symlink_to(blob)
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], f"error: --hf {d}: config.json is a "
          f"symlink to {blob}, which does not exist; download the model again")
    blob.mkdir(parents=True)
    fails(["to-megatron", "--hf", str(d), "--out", str(tmp_path / "o")], f"symlink to {blob}, which is not a file")
    no_leftovers(tmp_path, "o")


# ---- which library argument each flag sets (mutation audit round 3) ----------------------------

def test_flags_reach_the_library_as_given(src, mcore, tmp_path, cpu_parallel_state, capsys):
    """--dtype, the --make-vocab-size-divisible-by default (128, Megatron's) and --max-shard-size-gb (GiB: 2**30
    bytes) arrive in to_megatron / to_hf as the flags say; --tolerance 0 is a valid bound (">= 0"). Oracles: the
    source model is fp32 (make_hf_model), so bf16 can only come from --dtype; the shard layout of the library
    called directly with max_shard_bytes = GiB * 2**30."""
    from megatron_ext.checkpoint_layout import read_metadata
    from megatron_ext.convert import to_hf

    assert read_metadata(mcore)["vocab"]["make_vocab_size_divisible_by"] == 128  # the fixture: no flag given
    capsys.readouterr()
    assert cli.main(["to-megatron", "--hf", str(src), "--out", str(tmp_path / "bf"), "--dtype", "bf16",
                     "--tolerance", "0", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == "bfloat16"

    whole = to_hf(mcore, tmp_path / "whole", progress=False)  # one shard: the model's size
    size = sum(p.stat().st_size for p in (tmp_path / "whole").glob("*.safetensors"))
    gib = size / 2 / 2**30  # about half the model per shard: 2 or 3 shards
    assert cli.main(["to-hf", "--megatron", str(mcore), "--out", str(tmp_path / "cli"),
                     f"--max-shard-size-gb={gib!r}", "--no-progress"]) == 0
    to_hf(mcore, tmp_path / "lib", max_shard_bytes=int(gib * 2**30), progress=False)
    shards = {p: json.loads((tmp_path / p / "model.safetensors.index.json").read_text())["weight_map"]
              for p in ("cli", "lib")}
    assert shards["cli"] == shards["lib"] and len(set(shards["cli"].values())) >= 2, (whole, shards)


def test_every_tokenizer_file_is_copied_verbatim(src, mcore, tmp_path, cpu_parallel_state):
    """A Llama tokenizer folder's special_tokens_map.json and chat template travel with tokenizer.json and
    tokenizer_config.json, byte for byte (a file left out of TOKENIZER_FILES was silently dropped: mutation audit
    round 5). Oracle: the files as written."""
    from megatron_ext.convert import to_hf

    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tok / name)
    (tok / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>"}))
    (tok / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    r = to_hf(mcore, tmp_path / "out", tokenizer=tok, progress=False)
    names = sorted(p.name for p in tok.iterdir())
    assert sorted(r["tokenizer_files"]) == names
    assert all((tmp_path / "out" / n).read_bytes() == (tok / n).read_bytes() for n in names)


def test_a_shard_one_byte_short_is_refused_as_it_is_indexed(src, tmp_path):
    """A download one byte short is named when the shard's header is read, before any conversion work (the bound is
    the file's own size, not a few bytes past it: mutation audit round 5)."""
    from megatron_ext.convert.hf_io import ConvertError, SafetensorsReader

    d = copy_src(src, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-1])
    with pytest.raises(ConvertError, match=r"extends past the end of the file \((\d+) > \d+ bytes\); the file is trunc"):
        SafetensorsReader(d)


def test_an_index_naming_the_wrong_shard_is_an_incomplete_download(src, tmp_path):
    """model.safetensors.index.json that places a tensor in a shard without it: named as an incomplete download
    (which tensor, which shard), not as tensors missing from the model."""
    from megatron_ext.convert.hf_io import ConvertError, SafetensorsReader

    d = copy_src(src, tmp_path)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    shutil.copy(d / "model-00001-of-00002.safetensors", d / "model-00002-of-00002.safetensors")
    names = list(SafetensorsReader(src).names())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"  # it is there: the control below
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert SafetensorsReader(d).file_of["model.norm.weight"] == "model-00002-of-00002.safetensors"
    (d / "model-00002-of-00002.safetensors").write_bytes(_safetensors_without(d / "model-00002-of-00002.safetensors",
                                                                             "model.norm.weight"))
    with pytest.raises(ConvertError, match=r"1 tensors listed but not in their shard, e\.g\. model\.norm\.weight in "
                                           r"model-00002-of-00002\.safetensors; the download is incomplete"):
        SafetensorsReader(d)


def _safetensors_without(path, drop):
    from safetensors.torch import load_file, save

    tensors = load_file(str(path))
    del tensors[drop]
    return save(tensors, metadata={"format": "pt"})


def test_tokenizer_folder_ids_fill_only_what_the_checkpoint_lacks(src, mcore, tmp_path, cpu_parallel_state):
    """--tokenizer DIR's config.json token ids fill in only the ids the checkpoint's hf_config lacks (pad here): the
    checkpoint's own eos stays when that folder's config.json says another (mutation audit round 5)."""
    from megatron_ext.convert import to_hf

    ours = json.loads((src / "config.json").read_text())
    assert ours["eos_token_id"] == 2 and ours.get("pad_token_id") is None
    tok = copy_src(src, tmp_path)  # the model folder a run started from: config.json and the tokenizer files
    edit_config(tok, eos_token_id=9, pad_token_id=5)
    to_hf(mcore, tmp_path / "out", tokenizer=tok, progress=False)
    out = json.loads((tmp_path / "out/config.json").read_text())
    assert (out["eos_token_id"], out["pad_token_id"]) == (2, 5)


def test_a_busy_rendezvous_port_is_one_line(src, tmp_path):
    """to-megatron makes a one-process group; a MASTER_PORT another process holds was a DistNetworkError traceback."""
    import os
    import socket
    import subprocess

    from megatron_ext.runtime import ProcessEnv
    from megatron_ext.runtime.distributed import port_in_use

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")},
               "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([sys.executable, str(ROOT / "tools/convert.py"), "to-megatron", "--hf", str(src),
                               "--out", str(tmp_path / "o"), "--no-progress"], capture_output=True, text=True,
                              timeout=300, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert lines == [f"error: {port_in_use(ProcessEnv(0, 1, 0, '127.0.0.1', port, 'single'))}"], proc.stderr
    no_leftovers(tmp_path, "o")
