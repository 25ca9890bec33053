"""Recipe schema: types, unknown keys, extends, overrides and every cross-field rule."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ext.recipe import Recipe, RecipeError, load_recipe, parse_override

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "model": {"preset": "tiny"},
    "train": {"seq_length": 256, "steps": 3, "lr": 3e-5, "global_batch_size": 4},
    "cluster": {"nodes": 1, "gpus_per_node": 2},
    "runtime": {"device": "cpu"},
}


def load(overrides=(), raw=None, **kw):
    return load_recipe(raw=raw if raw is not None else BASE, overrides=list(overrides), **kw)


def test_valid_recipe_resolves_preset_and_rope():
    r = load()
    assert isinstance(r, Recipe)
    assert r.model.hidden_size == 64 and r.model.num_key_value_heads == 2
    assert r.rope.rope_type == "llama3" and r.rope.factor == 8.0
    assert r.data_parallel_size == 2


def test_recipe_is_frozen():
    r = load()
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        r.train.lr = 1.0


def test_string_floats_from_yaml_are_numbers():
    assert load(["train.lr=3e-5"]).train.lr == pytest.approx(3e-5)


@pytest.mark.parametrize("override, message", [
    (["train.lrr=1"], r"train\.lrr: unknown key \(did you mean 'lr'\?\); valid keys here: .*seq_length"),
    (["trian.lr=1"], r"trian: unknown key \(did you mean 'train'\?\)"),
    (["train.steps=abc"], r"train\.steps = 'abc': expected an integer"),
    (["train.steps=1.5"], r"train\.steps = 1\.5: expected an integer"),
    (["train.steps=true"], r"train\.steps = True: expected an integer"),  # a Python bool is an int: not here
    (["train.distributed_optimizer=3"], r"train\.distributed_optimizer = 3: expected true or false"),
    (["parallel.cp_comm_type=ring"], r"parallel\.cp_comm_type = 'ring': expected one of 'p2p', 'a2a', 'all_gather', 'a2a\+p2p'"),
    (["train.lr.x=1"], r"train\.lr\.x: train\.lr is a value, not a section"),
    (["train.steps"], r"expected dotted\.key=value"),
    (["train.lr=inf"], r"train\.lr = inf: must be a finite number"),  # passed `lr > 0`; diverged at step 2
    (["train.clip_grad=nan"], r"train\.clip_grad = nan: must be a finite number"),
])
def test_type_and_key_errors(override, message):
    with pytest.raises(RecipeError, match=message):
        load(override)


def test_a_section_left_empty_takes_its_defaults(tmp_path):
    """`checkpoint:` with every key under it commented out is YAML null: the section's defaults, as if absent."""
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(BASE) + "checkpoint:\n#  keep_last: 2\n")
    assert load_recipe(tmp_path / "r.yaml").checkpoint == load().checkpoint


def test_missing_required_field():
    raw = {**BASE, "train": {"steps": 3, "lr": 1e-3}}
    with pytest.raises(RecipeError, match=r"train\.seq_length: missing required field"):
        load(raw=raw)


def test_missing_architecture():
    raw = {**BASE, "model": {}}
    with pytest.raises(RecipeError, match=r"model\.num_hidden_layers: missing required field; .*model\.preset"):
        load(raw=raw)


@pytest.mark.parametrize("override, world, message", [
    (["parallel.tensor=2", "parallel.context=2"], 2,
     r"tensor x pipeline x context = 2 x 1 x 2 = 4 does not divide the world size = 2"),
    (["parallel.context=2", "train.seq_length=250"], 2, r"train\.seq_length = 250: must be divisible by 2 x parallel\.context = 4"),
    (["train.global_batch_size=3"], 2, r"train\.global_batch_size = 3: must be divisible by micro_batch_size x data parallel = 1 x 2"),
    (["parallel.tensor=3"], 3, r"parallel\.tensor = 3: must divide model\.num_attention_heads = 4"),
    (["parallel.tensor=4"], 4, r"parallel\.tensor = 4: must divide model\.num_key_value_heads = 2"),
    (["parallel.context=2", "parallel.tensor=2", "parallel.cp_comm_type=a2a"], 4,
     r"cp_comm_type = 'a2a': model\.num_key_value_heads per TP rank = 1 must be divisible by parallel\.context = 2"),
    (["parallel.context=4", "parallel.cp_comm_type=a2a"], 4,
     r"model\.num_key_value_heads per TP rank = 2 must be divisible by parallel\.context = 4"),
    (["parallel.context=2", "parallel.cp_comm_type=a2a+p2p"], 2, r"hierarchical_context_sizes = None: cp_comm_type 'a2a\+p2p' needs"),
    (["runtime.fp8=hybrid"], 2, r"runtime\.fp8 = 'hybrid': FP8 needs Transformer Engine on an sm89\+ GPU"),
    (["runtime.attention=te"], 2, r"runtime\.attention = 'te': Transformer Engine needs runtime\.device=cuda"),
    (["runtime.device=cuda", "runtime.fp8_attention=true"], 2, r"runtime\.fp8_attention = true: needs runtime\.fp8"),
    # TE would find no attention backend at the first forward (FP8 attention: BSHD/SBHD only, current scaling sm100+)
    (["runtime.device=cuda", "runtime.fp8=hybrid", "runtime.fp8_attention=true", "train.stage=sft",
      "parallel.context=1"], 2, r"runtime\.fp8_attention = true with train\.stage = 'sft': TE's FP8 attention does not "
                                r"take SFT's packed \(THD\) sequences"),
    (["runtime.device=cuda", "runtime.fp8=hybrid", "runtime.fp8_attention=true", "runtime.fp8_recipe=tensorwise",
      "cluster.gpu=h100-80gb"], 2,
     r"runtime\.fp8_recipe = 'tensorwise' on cluster\.gpu = 'h100-80gb': TE runs FP8 attention with current scaling "
     r"only on sm100 GPUs"),
    (["runtime.device=cuda", "runtime.fp8=hybrid", "runtime.fp8_attention=true", "runtime.fp8_recipe=tensorwise",
      "cluster.gpu=b200-180gb"], 2, None),
    # no GPU named (or one the schema does not list, GB200): the build checks the device itself (model.py)
    (["runtime.device=cuda", "runtime.fp8=hybrid", "runtime.fp8_attention=true", "runtime.fp8_recipe=tensorwise"], 2,
     None),
    (["runtime.device=cuda", "runtime.fp8=hybrid", "runtime.fp8_attention=true"], 2, None),  # delayed, CPT: fine
    (["parallel.pipeline=4"], 4, r"parallel\.pipeline = 4: must divide model\.num_hidden_layers = 2"),
    # Megatron asserted these at model build / parallel-state setup
    (["parallel.tensor=2", "model.intermediate_size=129"], 2,
     r"parallel\.tensor = 2: must divide model\.intermediate_size = 129"),
    (["parallel.context=2", "parallel.hierarchical_context_sizes=[1, 2]"], 2,
     r"parallel\.hierarchical_context_sizes = \[1, 2\]: used only with cp_comm_type 'a2a\+p2p' \(is 'p2p'\)"),
    (["rope.rope_type=yarn"], 2, None),  # yarn with the inherited factor is fine
    (["rope={rope_type: yarn}"], 2, r"rope\.factor: missing; rope_type 'yarn' needs a scaling factor"),
    (["train.min_lr=1"], 2, r"train\.min_lr = 1\.0: must be between 0 and train\.lr"),
    (["runtime.device=cuda", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.context=1",
      "train.seq_length=257"], 2, r"train\.seq_length = 257: with parallel\.sequence_parallel each rank's 257 tokens "
     r".* parallel\.tensor = 2 .* e\.g\. train\.seq_length = 260"),
    (["runtime.device=cuda", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.context=1",
      "train.seq_length=258"], 2, None),
    (["train.eval_interval=10"], 2, r"train\.eval_interval = 10: data\.split = '100,0,0' holds no documents out for "
     r"validation; .* data\.split=98,2,0\) or set train\.eval_interval=0"),
    (["train.eval_interval=10", "data.split=98/2"], 2, None),
    (["train.eval_interval=-1", "data.split=98,2,0"], 2, r"train\.eval_interval = -1: must be >= 0"),
    (["train.eval_iters=0"], 2, r"train\.eval_iters = 0: must be >= 1"),
    (["data.split=abc"], 2, r"data\.split = 'abc': expected train,valid,test weights such as '98,2,0'"),
    (["data.split=0,1,0"], 2, r"data\.split = '0,1,0': expected .* the train weight above 0"),
    (["data.split=1,2,3,4"], 2, r"data\.split = '1,2,3,4': expected"),
    (["data.split=98,-2,0"], 2, r"data\.split = '98,-2,0': expected"),
    (["data.split=100"], 2, r"data\.split = 100: expected a string; quote it: split: '100'"),
    (["data.prefix=[a, b]", "data.weights=[3, 1]"], 2, None),
    (["data.prefix=[a, b]"], 2, r"data\.prefix: a list of 2 prefixes needs data\.weights, one per prefix "
                                r"\(e\.g\. data\.weights=\[1, 1\]\)"),
    (["data.prefix=[a, b]", "data.weights=[1]"], 2, r"data\.weights = \[1\.0\]: 1 weights for 2 prefixes"),
    (["data.prefix=a", "data.weights=[1, 2]"], 2, r"data\.weights = \[1\.0, 2\.0\]: 2 weights for 1 prefixes"),
    (["data.prefix=[a, b]", "data.weights=[1, 0]"], 2, r"data\.weights = \[1\.0, 0\.0\]: every weight must be > 0"),
    (["data.prefix=[a, b]", "data.weights=[1, 1]", "train.stage=sft", "parallel.context=1",
      "train.global_batch_size=2"], 2, r"data\.prefix: a list of 2 prefixes with train\.stage = 'sft'"),
    # packs are not split over CP ranks, on any device (TE's THD attention would have got whole packs)
    (["train.stage=sft", "parallel.context=2", "runtime.device=cuda"], 2,
     r"parallel\.context = 2 with train\.stage = 'sft': packed SFT sequences are not split"),
    (["train.stage=sft", "parallel.context=1"], 2, None),
    # TE splits each TP rank's heads over the a2a group: 1 KV head per rank at TP 2
    (["parallel.context=2", "parallel.tensor=2", "parallel.cp_comm_type=a2a+p2p",
      "parallel.hierarchical_context_sizes=[2, 1]"], 4,
     r"hierarchical_context_sizes = \[2, 1\]: the a2a size 2 must divide model\.num_key_value_heads per TP rank = 1"),
    (["parallel.context=2", "parallel.tensor=2", "parallel.cp_comm_type=a2a+p2p",
      "parallel.hierarchical_context_sizes=[1, 2]"], 4, None),
    (["runtime.device=cuda", "runtime.attention=sdpa", "parallel.tensor=2", "parallel.sequence_parallel=true",
      "parallel.context=1"], 2, r"parallel\.sequence_parallel = true with runtime\.attention = 'sdpa'"),
    # Megatron-Core's int32 token count of a step: 512 x 4M wraps to negative (gradients left unscaled)
    (["train.global_batch_size=512", "train.seq_length=4194304"], 2,
     r"train\.global_batch_size x train\.seq_length = 512 x 4,194,304 = 2,147,483,648 tokens per step: .* int32"),
    (["train.global_batch_size=510", "train.seq_length=4194304"], 2, None),
])
def test_cross_field_rules(override, world, message):
    if message is None:
        load(override, world_size=world)
        return
    with pytest.raises(RecipeError, match=message):
        load(override, world_size=world)


@pytest.mark.parametrize("override, message", [
    # torch's AdamW raised a bare ValueError for these only after the model was built
    (["train.weight_decay=-1"], r"train\.weight_decay = -1\.0: must be >= 0"),
    (["train.adam_beta1=1"], r"train\.adam_beta1 = 1\.0: must be in \[0, 1\)"),
    (["train.adam_beta1=-0.1"], r"train\.adam_beta1 = -0\.1: must be in \[0, 1\)"),
    (["train.adam_beta2=1.5"], r"train\.adam_beta2 = 1\.5: must be in \[0, 1\)"),
    (["train.adam_eps=-1"], r"train\.adam_eps = -1\.0: must be > 0"),
    # 0 / (0 + 0) for every weight whose gradient is still 0: NaN weights after the first update
    (["train.adam_eps=0"], r"train\.adam_eps = 0\.0: must be > 0"),
    # numpy's RandomState (data order) takes 0..2**32-1 only
    (["train.seed=-1"], r"train\.seed = -1: must be between 0 and 2\*\*32 - 1 = 4294967295"),
    (["train.seed=4294967296"], r"train\.seed = 4294967296: must be between 0 and"),
    (["train.warmup_steps=-1"], r"train\.warmup_steps = -1: must be >= 0"),
    (["train.clip_grad=-1"], r"train\.clip_grad = -1\.0: must be >= 0 \(0 = no clipping\)"),
    (["runtime.timeout_minutes=0"], r"runtime\.timeout_minutes = 0: must be >= 1 \(default 30\)"),
    # 0 kept every checkpoint, -1 kept only the newest
    (["checkpoint.keep_last=0"], r"checkpoint\.keep_last = 0: must be a positive number of checkpoints, or null"),
    (["checkpoint.keep_last=-1"], r"checkpoint\.keep_last = -1: must be a positive number"),
    (["train.weight_decay=0", "train.adam_beta1=0", "train.adam_eps=1e-12", "train.seed=0", "train.seed=4294967295",
      "train.clip_grad=0", "checkpoint.keep_last=1", "checkpoint.keep_last=null"], None),
    # Megatron-Core asserts these deep in DDP / the optimizer, or ignores the bucket size without overlap
    (["train.overlap_param_gather=true"], r"train\.overlap_param_gather = true: needs train\.distributed_optimizer"
                                          r"=true and train\.overlap_grad_reduce=true"),
    (["train.overlap_grad_reduce=true", "train.overlap_param_gather=true", "train.distributed_optimizer=false"],
     r"train\.overlap_param_gather = true: needs"),
    (["train.ddp_bucket_size=1000"], r"train\.ddp_bucket_size = 1000: has an effect only with "
                                     r"train\.overlap_grad_reduce=true"),
    (["train.overlap_grad_reduce=true", "train.ddp_bucket_size=0"], r"train\.ddp_bucket_size = 0: must be >= 1"),
    (["train.overlap_grad_reduce=true", "train.overlap_param_gather=true", "train.ddp_bucket_size=1000"], None),
    # the plain optimizer's state has one format, which any layout loads
    (["checkpoint.optimizer_sharding=fully_reshardable", "train.distributed_optimizer=false"],
     r"checkpoint\.optimizer_sharding = 'fully_reshardable': only the distributed optimizer's state has a choice"),
    (["checkpoint.optimizer_sharding=fully_reshardable"], None),
    (["checkpoint.optimizer_sharding=model_space"], r"checkpoint\.optimizer_sharding"),
])
def test_optimizer_and_checkpoint_values(override, message):
    if message is None:
        load(override)
        return
    with pytest.raises(RecipeError, match=message):
        load(override)


def test_a2a_allowed_when_heads_divide():
    r = load(["parallel.context=2", "parallel.cp_comm_type=a2a"], world_size=2)
    assert r.parallel.cp_comm_type == "a2a"


def test_world_size_defaults_to_cluster():
    with pytest.raises(RecipeError, match=r"does not divide cluster\.nodes x cluster\.gpus_per_node = 2"):
        load(["parallel.context=4"])


def test_extends_merges_sections_and_replaces_rope(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**BASE, "rope": {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
        "original_max_position_embeddings": 32, "rope_theta": 500000}}))
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\ntrain: {seq_length: 512}\nrope: {rope_type: yarn, factor: 16, rope_theta: 500000}\n")
    r = load_recipe(tmp_path / "child.yaml")
    assert r.name == "child"
    assert r.train.seq_length == 512 and r.train.steps == 3  # merged
    assert r.rope.rope_type == "yarn" and r.rope.low_freq_factor is None  # replaced whole


def test_extends_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match=r"recipe file '.*nope\.yaml' not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match=r"recipe file '.*' is a folder; give the path to a \.yaml recipe"):
        load_recipe(tmp_path)
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(RecipeError, match=r"'.*bad\.yaml' line 2 column 1: not valid YAML: expected ',' or ']'"):
        load_recipe(tmp_path / "bad.yaml")
    # PyYAML alone keeps the last of two equal keys: lr would be 2e-5 without a word
    (tmp_path / "twice.yaml").write_text("extends: " + str(ROOT / "recipes/tiny/cpt.yaml") + "\ntrain:\n  lr: 1.0e-5\n"
                                         "  steps: 3\n  lr: 2.0e-5\n")
    with pytest.raises(RecipeError, match=r"line 5 column 3: not valid YAML: key 'lr' given twice \(first on line 3\)"):
        load_recipe(tmp_path / "twice.yaml")
    from megatron_ext.recipe_schema import load_yaml_mapping

    # a merge key's keys may be given again (that is what merging is for), also where the merged mapping is itself
    # merged (flattened) before its own turn; what yaml.safe_load reads, as yaml.safe_load reads it
    for text in ("b: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n", "=: 1\n",
                 "a: &a {x: 1}\nholder:\n  b: &b\n    <<: *a\n    x: 2\nc:\n  <<: *b\n"):
        assert load_yaml_mapping(text, "t") == yaml.safe_load(text)


def test_hf_config_source(tmp_path):
    import json

    from megatron_ext.presets import TINY

    cfg = {k: v for k, v in TINY.items() if k not in ("rope_theta", "rope_scaling", "rms_norm_eps")}
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                              "original_max_position_embeddings": 64}  # transformers-5 form
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    raw = {**BASE, "model": {"hf_config": str(tmp_path)}}
    r = load(raw=raw)
    assert r.model.num_hidden_layers == 2 and r.rope.rope_type == "yarn" and r.rope.factor == 4.0
    # no rms_norm_eps in the file: transformers' default 1e-6, as the converter reads the same file (not ours 1e-5)
    from megatron_ext.hf_config import normalize_hf_config

    assert "rms_norm_eps" not in cfg and r.model.rms_norm_eps == normalize_hf_config(cfg)["rms_norm_eps"] == 1e-6
    with pytest.raises(RecipeError, match=r"model\.hf_config = '.*missing': no config\.json there"):
        load(raw={**BASE, "model": {"hf_config": str(tmp_path / "missing")}})
    del cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RecipeError, match=r"model\.num_hidden_layers: missing required field; model\.hf_config = "
                                          r"'.*' has no num_hidden_layers in its config\.json"):
        load(raw=raw)
    (tmp_path / "config.json").write_text("{bad")
    with pytest.raises(RecipeError, match=r"model\.hf_config = '.*': .*config\.json is not valid JSON"):
        load(raw=raw)


@pytest.mark.parametrize("how", ["yaml null", "yaml {}", "override null", "override {}"])
def test_empty_rope_is_the_models_own(how, tmp_path):
    from megatron_ext.presets import PRESETS
    from megatron_ext.recipe_sources import rope_from_hf_config

    own = load_recipe(ROOT / "recipes/base/llama31_8b.yaml").rope
    assert own.rope_type == "llama3" and own.rope_theta == rope_from_hf_config(PRESETS["llama3.1-8b"])["rope_theta"]
    value = "null" if "null" in how else "{}"
    if how.startswith("yaml"):
        (tmp_path / "r.yaml").write_text(f"extends: {ROOT / 'recipes/cpt_1m.yaml'}\nrope: {value}\n")
        r = load_recipe(tmp_path / "r.yaml")
    else:
        r = load_recipe(ROOT / "recipes/cpt_1m.yaml", [f"rope={value}"])
    assert r.rope == own  # not the schema's default rope (theta 10000, no scaling)


def test_rope_block_keeps_the_models_theta_and_rotary_fraction(tmp_path):
    import json

    from megatron_ext.presets import TINY

    cfg = {**TINY, "rope_theta": 250000.0, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    r = load(raw={**BASE, "model": {"hf_config": str(tmp_path)}, "rope": yarn})
    assert (r.rope.rope_type, r.rope.rope_theta, r.rope.partial_rotary_factor) == ("yarn", 250000.0, 0.5)
    # set in the block, they win
    r = load(raw={**BASE, "model": {"hf_config": str(tmp_path)}, "rope": {**yarn, "rope_theta": 1e4}})
    assert r.rope.rope_theta == 1e4 and r.rope.partial_rotary_factor == 0.5
    r = load(raw={**BASE, "model": {"hf_config": str(tmp_path)}, "rope": yarn}, overrides=["rope.rope_theta=2e6"])
    assert r.rope.rope_theta == 2e6


def test_parse_override_values():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])


def _check(*args):
    return subprocess.run([sys.executable, "-m", "megatron_ext.recipe", "check", *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_cli_checks_every_shipped_recipe():
    files = sorted(str(p) for p in (ROOT / "recipes").rglob("*.yaml"))
    assert files, "no recipes shipped"
    proc = _check("--quiet", *files)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok: ") == len(files)


def test_cli_output_piped_into_a_reader_that_stops_early():
    """`recipe check --fields | head`: the reader closes the pipe before the listing ends; a Unix filter then ends
    quietly (it printed a BrokenPipeError traceback)."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ext.recipe", "check", "--fields"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before it writes: the listing (12 KB) could otherwise fit in the pipe and be written whole
    assert proc.stderr.read() == b"" and proc.wait() != 0


def test_cli_unknown_key_fails_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "train": {**BASE["train"], "seq_lenght": 5}}))
    proc = _check(str(bad))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "train.seq_lenght: unknown key (did you mean 'seq_length'?)" in proc.stderr


def test_cli_layout_not_dividing_world_fails(tmp_path):
    bad = tmp_path / "layout.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "parallel": {"tensor": 2, "context": 2}}))
    proc = _check(str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "= 4 does not divide cluster.nodes x cluster.gpus_per_node = 2" in proc.stderr
    assert _check(str(bad), "--world-size", "8").returncode == 0


def test_cli_override_given_as_a_file_fails_before_printing(capsys):
    """`recipe check FILE train.steps=10` (an override given positionally, as `train` takes it) printed FILE's whole
    resolved recipe and 'ok: FILE' before the error: a page of output that reads as success. Nothing now."""
    from megatron_ext.recipe_cli import main

    tiny = str(ROOT / "recipes/tiny/cpt.yaml")
    assert main(["check", tiny, "train.steps=10"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "error: train.steps=10: not a recipe file but an override, it seems; give overrides with --set " \
                  "train.steps=10\n"


def test_cli_overrides_given_positionally_are_one_error_line_and_a_key_twice_is_the_last():
    """`recipe check R train.steps=3 train.steps=5` printed two `error:` lines (one per positional override) while
    `--set train.steps=3 --set train.steps=5` ran with 5. The rule for overrides is the last one applies: launch
    relies on it (--nodes after a cluster.nodes override, STAGE:key after key, the SFT stage's init_from after one
    for every stage) and the trainer and tools/plan.py apply it; a key twice in a YAML file is refused. Positional
    overrides stay refused in `recipe check`, now in one line whose fix is the --set form. Control (old code): two
    error lines."""
    tiny = "recipes/tiny/cpt.yaml"
    proc = _check("--quiet", tiny, "train.steps=3", "train.steps=5")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: train.steps=3, train.steps=5: not recipe files but overrides, it seems; give overrides with --set "
        "train.steps=3 --set train.steps=5"], proc.stderr
    proc = _check(tiny, "--set", "train.steps=3", "--set", "train.steps=5")
    assert proc.returncode == 0 and "\n  steps: 5\n" in proc.stdout, proc.stdout + proc.stderr
    launch = subprocess.run([sys.executable, "-m", "megatron_ext.launch", "--recipe", tiny, "--get", "train.steps",
                             "train.steps=3", "--set", "train.steps=5"], capture_output=True, text=True, cwd=ROOT)
    assert launch.returncode == 0 and launch.stdout == "5\n", launch.stderr

@pytest.mark.parametrize("text", ["", "# a comment alone\n"])
def test_empty_recipe_file(tmp_path, text):
    """An empty recipe file was read as `{}`: 'train.seq_length: missing required field', which sends one looking
    for a field, not at the file (the trainer, launch --check and recipe check all load recipes here)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(RecipeError) as e:
        load_recipe(empty)
    assert str(e.value) == (f"recipe file {str(empty)!r} is empty (no settings, or comments alone); write the "
                            "recipe in it, or give another file (see recipes/)")


def test_cli_warns_of_a_sequence_beyond_the_models_positions(capsys):
    """`recipe check --set train.seq_length=4096` on a 2048-position model said nothing, where `launch --check`
    warns that the checkpoint will claim 2048 positions. Control: the recipe's own length warns of nothing."""
    from megatron_ext.recipe_cli import main

    tiny = str(ROOT / "recipes/tiny/cpt.yaml")
    assert main(["check", "--quiet", "--set", "train.seq_length=4096", tiny]) == 0
    err = capsys.readouterr().err
    assert err == (f"warning: {tiny}: train.seq_length = 4,096 is beyond model.max_position_embeddings = 2,048: the "
                   "checkpoint and its export will claim 2,048 positions; set model.max_position_embeddings (and the "
                   "rope block) for the trained length, e.g. the recipe of that length\n")
    assert main(["check", "--quiet", tiny]) == 0
    assert capsys.readouterr().err == ""


def test_cli_a_recipe_file_whose_name_has_an_equals_sign_is_a_file(tmp_path, capsys):
    """Only a KEY=VALUE that is not an existing file is taken for an override given positionally: a recipe saved
    as `seq=4k.yaml` is checked as the recipe it is (mutation audit round 3: dropping the exists() test refused it)."""
    import shutil

    from megatron_ext.recipe_cli import main

    shutil.copytree(ROOT / "recipes/tiny", tmp_path / "tiny")  # with the base recipe it names
    recipe = tmp_path / "tiny" / "seq=4k.yaml"
    shutil.copy(ROOT / "recipes/tiny/cpt.yaml", recipe)
    assert main(["check", "--quiet", str(recipe)]) == 0
    assert capsys.readouterr().out == f"ok: {recipe}\n"


def _hf_config_dir(tmp_path, cfg: dict) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_model_source_pins(tmp_path):
    """recipe_sources mutants (mutation audit round 4), against transformers' LlamaConfig reading the same file:
    the file's rms_norm_eps wins over the 1e-6 default; `rope_type` wins over the old `type` when both are given;
    a rotary fraction inside rope_parameters wins over a top-level one; `model.X: null` takes the source's value
    (the tiny preset's 2 KV heads, not MHA); preset and hf_config together are refused."""
    from transformers import LlamaConfig

    from megatron_ext.presets import TINY

    def both(cfg):
        r = load(raw={**BASE, "model": {"hf_config": _hf_config_dir(tmp_path, cfg)}})
        return r, LlamaConfig(**cfg)

    r, hf = both({**TINY, "rms_norm_eps": 1e-5})
    assert r.model.rms_norm_eps == hf.rms_norm_eps == 1e-5
    r, hf = both({**TINY, "rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 2.0}})
    assert r.rope.rope_type == hf.rope_parameters["rope_type"] == "dynamic"
    base = {k: v for k, v in TINY.items() if k not in ("rope_theta", "rope_scaling")}
    r, hf = both({**base, "partial_rotary_factor": 0.25, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    assert r.rope.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5
    r = load(raw={**BASE, "model": {"preset": "tiny", "num_key_value_heads": None}})
    assert r.model.num_key_value_heads == TINY["num_key_value_heads"] == 2
    with pytest.raises(RecipeError, match=r"^model\.preset and model\.hf_config are both set; keep one$"):
        load(raw={**BASE, "model": {"preset": "tiny", "hf_config": _hf_config_dir(tmp_path, TINY)}})
