"""Starting points: a converted HF model (step-1 loss = transformers' loss), and resuming with another global batch."""

import json
import subprocess
import sys

import torch

from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_init_from_converted_hf_model_matches_transformers_loss(tmp_path, torchrun, token_data, toy_tokenizer):
    """... and the trained stage exports as the model it started from: its tokenizer, generation config and eos
    ids (before: an empty generation_config.json and transformers' Llama-2 eos 2, so generate() never stopped)."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from megatron_ext.convert import to_hf

    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.presets import TINY
    from megatron_ext.recipe import load_recipe
    from megatron_ext.training_data import TrainBatches

    # A "released" HF model with the tiny architecture and the recipe's YaRN rope.
    recipe = load_recipe(RECIPE, [f"data.prefix={token_data}", f"checkpoint.dir={tmp_path / 'run'}",
                                  "train.seq_length=256", "train.global_batch_size=2", "train.steps=1"])
    rope = hf_config_from_recipe(recipe)["rope_scaling"]  # the recipe's rope block, as an HF config holds it
    torch.manual_seed(0)
    # weights 5x HF's init and random norms: at the default init the mean loss barely moves with the rope or a
    # head permutation (7e-6 and 3e-5, under this test's 1e-4)
    arch = {**TINY, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": [2, 7],
            "initializer_range": 0.1}
    hf = LlamaForCausalLM(LlamaConfig(**{**arch, "rope_scaling": rope}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 7], temperature=0.6, do_sample=True)
    hf.save_pretrained(tmp_path / "hf")
    AutoTokenizer.from_pretrained(toy_tokenizer).save_pretrained(tmp_path / "hf")
    subprocess.run([sys.executable, str(ROOT / "tools/convert.py"), "to-megatron", "--hf", str(tmp_path / "hf"),
                    "--out", str(tmp_path / "mg"), "--dtype", "fp32"], check=True, capture_output=True)

    torchrun("megatron_ext.train", 2, "--recipe", str(RECIPE), f"data.prefix={token_data}",
             f"checkpoint.dir={tmp_path / 'run'}", f"checkpoint.init_from={tmp_path / 'mg'}",
             "train.seq_length=256", "train.global_batch_size=2", "train.steps=1", module=True)
    ours = metrics(tmp_path / "run")[0]["loss"]

    # transformers' loss on exactly the samples of step 1 (CP=1 view of the same data).
    batches = TrainBatches(recipe, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    micro = [batches.microbatch(0, m) for m in range(2)]  # the two sequences of the global batch
    batch = {k: torch.cat([b[k] for b in micro]) for k in ("tokens", "labels")}
    assert batch["tokens"].shape == (2, 256)
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits.float()
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert abs(ours - theirs.item()) <= 1e-4, (ours, theirs.item())
    # control: the same weights with the plain (unscaled) rope give a loss far outside that tolerance
    plain = LlamaForCausalLM(LlamaConfig(**{**arch, "rope_scaling": None}))
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        other = plain(batch["tokens"]).logits.float()
    unscaled = torch.nn.functional.cross_entropy(other.reshape(-1, other.shape[-1]), batch["labels"].reshape(-1))
    assert abs(unscaled.item() - theirs.item()) > 1e-3, (unscaled.item(), theirs.item())

    report = to_hf(tmp_path / "run", tmp_path / "export", progress=False)
    config = json.loads((tmp_path / "export/config.json").read_text())
    generation = json.loads((tmp_path / "export/generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, [2, 7]) and "warning" not in report, report
    assert generation == json.loads((tmp_path / "hf/generation_config.json").read_text())
    assert "tokenizer.json" in report["tokenizer_files"]


def test_resume_with_another_global_batch_goes_on_where_it_stopped(tmp_path, torchrun, token_data):
    """Two steps of 4 samples, then two of 2: the run reads samples 8..11 next (not 4..7, which step x batch
    would give) and its checkpoint counts 12 samples; the same run resumed at CP 2 reads the same."""
    from megatron_ext.checkpoint_layout import read_metadata
    from megatron_ext.data.dataset_files import data_identity

    args = ["--recipe", str(RECIPE), f"data.prefix={token_data}", f"checkpoint.dir={tmp_path}",
            "train.seq_length=256", "parallel.context=1"]
    torchrun("megatron_ext.train", 1, *args, "train.global_batch_size=4", "train.steps=2", module=True)
    assert read_metadata(tmp_path)["consumed_samples"] == 8
    out = torchrun("megatron_ext.train", 2, *args, "train.global_batch_size=2", "train.steps=4",
                   "parallel.context=2", module=True)
    assert "resumed from" in out and "warning" not in out
    assert [(m["step"], m["tokens"]) for m in metrics(tmp_path)] == [(1, 1024), (2, 2048), (3, 2560), (4, 3072)]
    meta = read_metadata(tmp_path)
    assert (meta["consumed_samples"], meta["tokens"]) == (12, 12 * 256)
    # rank 0 records what the data holds, and found the same at the resume (no warning above)
    assert meta["data_identity"] == {token_data: data_identity(token_data)}
