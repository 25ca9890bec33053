"""megatron_ext.checkpoint: layout, metadata, model+optimizer+scheduler round trip, clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_ext.checkpoint import METADATA_FILE, CheckpointError, load_checkpoint, save_checkpoint
from megatron_ext.checkpoint_layout import latest_iteration, read_metadata
from megatron_ext.checkpoint_index import read_dcp_index
from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY


def setup(seed: int, distributed_optimizer: bool):
    """Tiny model, DDP wrapper, Megatron optimizer and LR scheduler (what the trainer builds)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(seed)
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1, bf16=False,
                                                 params_dtype=torch.float32,
                                                 use_distributed_optimizer=distributed_optimizer), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="constant")
    return model, ddp, opt, sched


def step(ddp, opt, sched, seed: int) -> None:
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(seed))
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tokens, torch.arange(32).expand(2, 32), None, labels=torch.roll(tokens, -1, 1)).mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed-adam"])
def test_resume_continues_exactly(tmp_path, cpu_parallel_state, distributed_optimizer):
    root = tmp_path / "ckpt"
    model, ddp, opt, sched = setup(1, distributed_optimizer)
    step(ddp, opt, sched, 0)
    step(ddp, opt, sched, 1)
    save_checkpoint(root, 2, [model], optimizer=opt, scheduler=sched, metadata={"hf_config": TINY},
                    extra={"tokens_seen": 128, "rng": torch.arange(3)})
    step(ddp, opt, sched, 2)
    expected = params(model)

    model2, ddp2, opt2, sched2 = setup(2, distributed_optimizer)  # other init: everything must come from disk
    it, extra = load_checkpoint(root, [model2], optimizer=opt2, scheduler=sched2)
    assert it == 2 and extra["tokens_seen"] == 128 and torch.equal(extra["rng"], torch.arange(3))
    assert sched2.num_steps == sched.num_steps - 1
    step(ddp2, opt2, sched2, 2)
    got = params(model2)
    assert all(torch.equal(expected[k], got[k]) for k in expected)

    # a training checkpoint (optimizer keys, no converter metadata) exports to HF with equal logits
    from megatron_ext.convert import to_hf

    report = to_hf(root, tmp_path / "hf", verify=True, progress=False)
    assert report["max_abs_logit_diff"] < 1e-4 and report["dtype"] == "float32"

    # negative control: weights only (fresh Adam moments, fresh schedule) gives another update
    model3, ddp3, opt3, sched3 = setup(3, distributed_optimizer)
    load_checkpoint(root, [model3], optimizer=opt3, scheduler=sched3, weights_only=True)
    step(ddp3, opt3, sched3, 2)
    assert not all(torch.equal(expected[k], v) for k, v in params(model3).items())


def test_layout_metadata_and_plain_tensors(tmp_path, cpu_parallel_state):
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    assert latest_iteration(root) is None
    save_checkpoint(root, 10, [model], metadata={"hf_config": TINY, "tokenizer": "/x/tok", "recipe": {"a": 1}})
    save_checkpoint(root, 20, [model], metadata={"hf_config": TINY}, keep_last=None)
    assert latest_iteration(root) == 20
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "20\n"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000010", "iter_0000020",
                                                       "latest_checkpointed_iteration.txt"]
    meta = read_metadata(root / "iter_0000010")
    assert meta["hf_config"]["rope_scaling"] == TINY["rope_scaling"] and meta["tokenizer"] == "/x/tok"
    assert meta["recipe"] == {"a": 1} and meta["iteration"] == 10 and meta["parallel"]["tensor"] == 1
    assert meta["versions"]["torch"] and meta["versions"]["megatron-core"].startswith("0.16")
    assert read_metadata(root)["iteration"] == 20  # a root reads its latest
    plain = dist_checkpointing.load_plain_tensors(str(root / "iter_0000020"))
    assert torch.equal(plain["decoder.layers.self_attention.linear_qkv.weight"][1],
                       model.decoder.layers[1].self_attention.linear_qkv.weight)
    assert torch.equal(plain["decoder.layers.mlp.linear_fc1.weight"][0], model.decoder.layers[0].mlp.linear_fc1.weight)
    # re-saving an iteration replaces it; keep_last prunes old ones
    save_checkpoint(root, 30, [model], metadata={"hf_config": TINY}, keep_last=2)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000020", "iter_0000030"]
    # a folder a killed prune left (renamed before its removal, so never a half iter_*) goes at the next save, also
    # one under the name the next prune renames to (iteration 20 after a rollback)
    (root / ".iter_0000005.deleting").mkdir()
    (root / ".iter_0000020.deleting").mkdir()
    (root / ".iter_0000020.deleting/common.pt").write_text("left")
    save_checkpoint(root, 40, [model], metadata={"hf_config": TINY}, keep_last=2)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith((".iter", "iter"))) == ["iter_0000030",
                                                                                            "iter_0000040"]


def test_crashed_save_leaves_previous_checkpoint(tmp_path, cpu_parallel_state, monkeypatch):
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(dist_checkpointing, "save", boom)
    with pytest.raises(OSError):
        save_checkpoint(root, 2, [model], metadata={"hf_config": TINY})
    assert latest_iteration(root) == 1 and not (root / "iter_0000002").exists()
    monkeypatch.undo()
    save_checkpoint(root, 2, [model], metadata={"hf_config": TINY})  # the partial leftover is cleaned up
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000002",
                                                       "latest_checkpointed_iteration.txt"]


def test_errors(tmp_path, cpu_parallel_state):
    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", [model])
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"a\.txt is a file; give the folder that holds iter_\*"):
        load_checkpoint(tmp_path / "a.txt", [model])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"hf is a Hugging Face model folder \(config\.json\), not a Megatron"):
        load_checkpoint(tmp_path / "hf", [model])
    with pytest.raises(CheckpointError, match="must contain 'hf_config'"):
        save_checkpoint(root, 1, [model], metadata={})
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})
    with pytest.raises(CheckpointError, match=r"no iteration 5 .*available: \[1\]"):
        load_checkpoint(root, [model], iteration=5)
    wide = build_model(dict(TINY, hidden_size=128), BuildOptions(device="cpu", seq_length=32))
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 64, model 128"):
        load_checkpoint(root, [wide])
    deep = build_model(dict(TINY, num_hidden_layers=3), BuildOptions(device="cpu", seq_length=32))
    with pytest.raises(CheckpointError, match="num_hidden_layers: checkpoint 2, model 3"):
        load_checkpoint(root, [deep])
    padded = build_model(TINY, BuildOptions(device="cpu", seq_length=32, make_vocab_size_divisible_by=1024))
    with pytest.raises(CheckpointError, match="padded vocabulary rows differ"):
        load_checkpoint(root, [padded])
    tied = build_model(dict(TINY, tie_word_embeddings=True), BuildOptions(device="cpu", seq_length=32))
    load_checkpoint(root, [tied])  # untied checkpoint into tied model: output layer is simply not used
    (root / "latest_checkpointed_iteration.txt").write_text("abc")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        latest_iteration(root)
    (root / "iter_0000001" / METADATA_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_metadata(root / "iter_0000001")
    json.dumps  # noqa: B018


def test_an_iteration_folder_loads_that_iteration(tmp_path, cpu_parallel_state):
    """An `iter_*` folder given instead of the root (checkpoint.init_from, niah --megatron, convert --megatron)
    loads that iteration, not the root's latest."""
    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})
    first = params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_checkpoint(root, 2, [model], metadata={"hf_config": TINY})
    fresh = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    assert load_checkpoint(root / "iter_0000001", [fresh], weights_only=True)[0] == 1
    assert all(torch.equal(v, first[k]) for k, v in params(fresh).items())
    assert load_checkpoint(root, [fresh], weights_only=True)[0] == 2  # the root: its latest
    assert not any(torch.equal(v, first[k]) for k, v in params(fresh).items())
    with pytest.raises(CheckpointError, match=r"iter_0000001 is iteration 1, not the iteration 2 asked for"):
        load_checkpoint(root / "iter_0000001", [fresh], iteration=2)


def test_weights_only_load_unpickles_nothing(tmp_path, cpu_parallel_state, monkeypatch):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})

    def no_unpickling(self, read_item, value):
        raise AssertionError(f"unpickled {read_item.dest_index.fqn}")

    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", no_unpickling)
    fresh = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    load_checkpoint(root, [fresh], weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    with pytest.raises(BaseException) as err:  # control (torch raises a BaseException subclass): a full load does read the objects
        load_checkpoint(root, [fresh])
    assert "unpickled" in str(err.value) + repr(getattr(err.value, "failures", ""))


def test_crafted_index_is_refused_before_torch_unpickles_it(tmp_path, cpu_parallel_state):
    import os
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})
    (root / "iter_0000001/.metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        load_checkpoint(root, [model], weights_only=True)
    assert not (tmp_path / "pwned").exists()
    # an allowed module with a dotted name: pickle (protocol 4+) resolves it attribute by attribute, so a module
    # allow-list let torch.distributed.checkpoint.filesystem + "os.system" through, in the vetting itself (convert)
    # and, with torch's classes stubbed, to torch's own unpickling of the same file (every load)
    payload = f"touch {tmp_path / 'pwned'}".encode()
    dotted = (b"\x80\x04\x8c'torch.distributed.checkpoint.filesystem\x94\x8c\tos.system\x94\x93\x94"
              + b"\x8c" + bytes([len(payload)]) + payload + b"\x94\x85\x94R\x94.")
    (root / "iter_0000001/.metadata").write_bytes(dotted)
    for read in (lambda: load_checkpoint(root, [model], weights_only=True),
                 lambda: read_dcp_index(root / "iter_0000001")):
        with pytest.raises(CheckpointError, match="refusing to load torch.distributed.checkpoint.filesystem.os.system"):
            read()
        assert not (tmp_path / "pwned").exists()


def _saved(tensor=1, pipeline=1, context=1, data=2, distributed=True, has_optimizer=True, **train):
    return {"has_optimizer": has_optimizer, "recipe": {"train": {"distributed_optimizer": distributed, **train}},
            "parallel": {"tensor": tensor, "pipeline": pipeline, "context": context, "data": data}}


OVERLAP = dict(overlap_grad_reduce=True, ddp_bucket_size=20000)


@pytest.mark.parametrize("saved, layout, distributed, why", [
    # the distributed optimizer's DP x CP slices reshard; its TP x PP buckets do not
    (_saved(), dict(tensor=1, pipeline=1, context=1, data=2), True, None),
    (_saved(), dict(tensor=1, pipeline=1, context=2, data=4), True, None),
    (_saved(), dict(tensor=2, pipeline=1, context=1, data=1), True, "parallel.tensor 1 -> 2"),
    (_saved(pipeline=2), dict(tensor=1, pipeline=1, context=1, data=2), True, "parallel.pipeline 2 -> 1"),
    # saved fully_reshardable (checkpoint.optimizer_sharding), in the parameters' shapes: any layout
    ({**_saved(), "optimizer_sharding": "fully_reshardable"}, dict(tensor=2, pipeline=2, context=1, data=1), True,
     None),
    ({**_saved(), "optimizer_sharding": "dp_reshardable"}, dict(tensor=2, pipeline=1, context=1, data=1), True,
     "re-save it once with `tools/checkpoint.py reshard`, and save with checkpoint.optimizer_sharding="
     "fully_reshardable"),
    ({**_saved(), "optimizer_sharding": "fully_reshardable"}, dict(tensor=1, pipeline=1, context=1, data=2), False,
     "train.distributed_optimizer was True, now False"),
    # the plain optimizer follows each parameter's sharding: any layout
    (_saved(distributed=False), dict(tensor=2, pipeline=2, context=1, data=1), False, None),
    (_saved(distributed=False), dict(tensor=1, pipeline=1, context=1, data=2), True,
     "train.distributed_optimizer was False, now True"),
    (_saved(has_optimizer=False), dict(tensor=1, pipeline=1, context=1, data=2), True, "no optimizer state"),
    ({"hf_config": {}}, dict(tensor=1, pipeline=1, context=1, data=2), True, "does not record"),
])
def test_optimizer_state_mismatch(saved, layout, distributed, why):
    from megatron_ext.checkpoint_index import optimizer_state_mismatch

    got = optimizer_state_mismatch(saved, layout, distributed)
    assert got is None if why is None else why in got


@pytest.mark.parametrize("saved, data, bucket_size, why", [
    # the distributed optimizer's state follows its gradient buckets (train.overlap_grad_reduce, ddp_bucket_size)
    (_saved(**OVERLAP), 2, 20000, None),
    (_saved(**OVERLAP), 4, 20000, None),
    (_saved(), 2, 20000, "one bucket when saved, buckets of 20,000 parameters now (train.overlap_grad_reduce"),
    (_saved(**OVERLAP), 2, None, "buckets of 20,000 parameters when saved, one bucket now"),
    # Megatron-Core's default, max(40M, 1M x DP): the same up to DP 40, then growing with DP
    (_saved(data=2, overlap_grad_reduce=True), 32, 40_000_000, None),
    (_saved(data=64, overlap_grad_reduce=True), 32, 40_000_000, "buckets of 64,000,000 parameters when saved"),
    (_saved(distributed=False), 2, 20000, None),  # the plain optimizer's state is per parameter
    ({**_saved(), "optimizer_sharding": "fully_reshardable"}, 2, 20000, None),  # and so is a fully_reshardable one
])
def test_changed_gradient_buckets(saved, data, bucket_size, why):
    from megatron_ext.checkpoint_index import optimizer_state_mismatch

    layout = dict(tensor=1, pipeline=1, context=1, data=data)
    got = optimizer_state_mismatch(saved, layout, saved["recipe"]["train"]["distributed_optimizer"],
                                   bucket_size=bucket_size)
    assert got is None if why is None else why in got, got


@pytest.mark.parametrize("overrides", [[], ["train.overlap_grad_reduce=true"],
                                       ["train.overlap_grad_reduce=true", "train.ddp_bucket_size=20000"]])
def test_gradient_bucket_size_is_megatrons(cpu_parallel_state, overrides):
    """gradient_bucket_size (which the resume decision uses) against the DDP the trainer builds."""
    from megatron_ext.checkpoint_index import gradient_bucket_size
    from megatron_ext.recipe import load_recipe
    from megatron_ext.train import wrap_ddp

    recipe = load_recipe(Path(__file__).parents[2] / "recipes/tiny/cpt.yaml",
                         ["parallel.context=1", "train.seq_length=32", *overrides], world_size=1)
    ddp = wrap_ddp(recipe, build_model(TINY, BuildOptions(device="cpu", seq_length=32)))
    t = recipe.train
    assert ddp.ddp_config.bucket_size == gradient_bucket_size(t.overlap_grad_reduce, t.ddp_bucket_size, 1)
    assert (len(ddp.bucket_groups) > 1) == (t.ddp_bucket_size is not None)  # the tiny model: 158K parameters


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "__0_1.distcp").write_bytes((d / "__0_1.distcp").read_bytes()[:100]), "__0_1.distcp has 100 bytes"),
    (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda d: (d / "common.pt").unlink(), "common.pt is missing"),
])
def test_incomplete_checkpoint_is_named_at_load(tmp_path, cpu_parallel_state, damage, message):
    """A truncated or missing shard (a partial copy) is one clear error, not an EOFError from inside torch."""
    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})
    load_checkpoint(root, [model], weights_only=True)  # complete: loads
    damage(root / "iter_0000001")
    with pytest.raises(CheckpointError, match=f"iter_0000001: incomplete checkpoint: {message}"):
        load_checkpoint(root, [model], weights_only=True)


def zero_after(file: Path, keep: int = 4096) -> None:
    """Damage `file` as a bad copy does, keeping its size: everything after its first `keep` bytes becomes zeros."""
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(keep)
        f.truncate(size)


@pytest.mark.parametrize("weights_only", [True, False], ids=["init_from", "resume"])
def test_a_damaged_shard_is_named_at_load(tmp_path, cpu_parallel_state, weights_only):
    """A shard of the right size whose bytes are damaged passes the size check; torch then failed deep inside its
    read (UnpicklingError 'Unsupported operand 0' in a CheckpointException, naming no file). Now one CheckpointError
    naming the file and the fix. Control (old code): torch's CheckpointException."""
    root = tmp_path / "ckpt"
    model, ddp, opt, sched = setup(0, True)
    step(ddp, opt, sched, 0)
    save_checkpoint(root, 1, [model], optimizer=opt, scheduler=sched, metadata={"hf_config": TINY})
    shard = sorted((root / "iter_0000001").glob("*.distcp"))[-1]
    zero_after(shard)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root, [model], optimizer=opt, scheduler=sched, weights_only=weights_only)
    assert re.fullmatch(re.escape(f"{shard}: cannot read its tensors (corrupt shard: ") + r"(all \d+ items stored in "
                        r"it are|\d+ of the \d+ items in it are) damaged; the first, bytes [\d,]+-[\d,]+: File is not "
                        r"a zip file\); copy the checkpoint again or use an earlier iteration", str(e.value)), e.value
    assert not getattr(e.value, "alike_on_every_rank", False)  # what this rank read: each rank says its own


def test_save_with_a_lost_shard_keeps_the_previous_checkpoint(tmp_path, cpu_parallel_state, monkeypatch):
    """A shard that never reached the filesystem (a node's write lost): the save fails before the rename."""
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})
    real_save = dist_checkpointing.save

    def save_then_lose_a_shard(state, directory, **kwargs):
        out = real_save(state, directory, **kwargs)
        sorted(Path(directory).glob("*.distcp"))[-1].unlink()
        return out

    monkeypatch.setattr(dist_checkpointing, "save", save_then_lose_a_shard)
    with pytest.raises(CheckpointError, match="save of iteration 2 failed: .*incomplete checkpoint: __0_1.distcp is missing"):
        save_checkpoint(root, 2, [model], metadata={"hf_config": TINY})
    assert latest_iteration(root) == 1 and not (root / "iter_0000002").exists()


def test_a_full_disk_at_the_latest_pointer_is_one_error(tmp_path, cpu_parallel_state):
    """Rank 0 writes the metadata and the latest pointer alone: an OSError there (a full disk: /dev/full under the
    pointer's temporary name, ENOSPC for real) was raised by rank 0 alone while the other ranks waited at a barrier
    for the job's timeout. Now rank 0's outcome is broadcast and every rank raises the same CheckpointError; the
    folder is in place, the pointer still names the previous iteration. Control (old code): a bare OSError."""
    from megatron_ext.checkpoint_space import CheckpointSpaceError

    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    save_checkpoint(root, 1, [model], metadata={"hf_config": TINY})
    (root / ".latest_checkpointed_iteration.txt.tmp").symlink_to("/dev/full")
    with pytest.raises(CheckpointSpaceError) as e:
        save_checkpoint(root, 2, [model], metadata={"hf_config": TINY})
    assert str(e.value).startswith(f"checkpoint folder {root}: no space left on device while pointing "
                                   "latest_checkpointed_iteration.txt at iteration 2 ("), e.value
    assert str(e.value).endswith(" free there now); iter_0000002 is complete but the latest is still iteration 1; "
                                 "free space there or save elsewhere"), e.value
    assert getattr(e.value, "alike_on_every_rank", False)
    assert latest_iteration(root) == 1 and sorted(p.name for p in root.iterdir()) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]


class _NormWithExtraState(torch.nn.RMSNorm):
    """A final norm with extra state, as TE's is (its FP8 scaling history; `set_extra_state(None)` is a no-op)."""

    def get_extra_state(self):
        return torch.tensor([1.0])

    def set_extra_state(self, state):
        self.restored = state


def test_full_resume_where_a_module_gained_extra_state(tmp_path, cpu_parallel_state):
    """Saved by the sdpa model (torch's final norm, no extra state), resumed with TE's (its norm has some): the
    checkpoint has nothing for it, which was a missing-key failure of the load; now it loads as None. Extra state the
    checkpoint holds is still loaded (the control: a checkpoint saved with it)."""
    root = tmp_path / "ckpt"
    model, ddp, opt, sched = setup(1, True)
    step(ddp, opt, sched, 0)
    save_checkpoint(root, 1, [model], optimizer=opt, scheduler=sched, metadata={"hf_config": TINY})
    model2, ddp2, opt2, sched2 = setup(2, True)
    norm = model2.decoder.final_layernorm
    norm.__class__ = _NormWithExtraState
    assert "decoder.final_layernorm._extra_state" in model2.state_dict()
    load_checkpoint(root, [model2], optimizer=opt2, scheduler=sched2)
    assert norm.restored is None
    torch.testing.assert_close(params(model2), params(model), rtol=0, atol=0)
    save_checkpoint(root, 2, [model2], optimizer=opt2, scheduler=sched2, metadata={"hf_config": TINY})
    norm.restored = "not loaded"
    load_checkpoint(root, [model2], optimizer=opt2, scheduler=sched2)
    assert torch.equal(norm.restored, torch.tensor([1.0]))


def test_a_root_named_like_an_iteration_is_a_root(tmp_path):
    """A checkpoint root whose own name is iter_N (it holds the latest pointer) resolves to its latest iteration,
    not to itself as iteration N."""
    from megatron_ext.checkpoint_layout import resolve_iteration_dir

    root = tmp_path / "iter_0000005"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")
    assert resolve_iteration_dir(root) == (3, root / "iter_0000003")
    assert resolve_iteration_dir(root / "iter_0000003") == (3, root / "iter_0000003")  # an iteration folder itself


def test_carry_forward_takes_only_what_the_recipe_does_not_set(tmp_path):
    """The run's metadata keeps what its recipe set (tokenizer folder, generation config, bos/eos/pad ids) and takes
    the starting checkpoint's where it has none; a tokenizer folder beats a hub name, whichever side holds it."""
    from megatron_ext.checkpoint_layout import carry_forward

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    source = {"tokenizer": str(folder), "generation_config": {"eos_token_id": [128001, 128009]},
              "hf_config": {"bos_token_id": 128000, "eos_token_id": 128009, "pad_token_id": 128004}}

    hub = {"tokenizer": "meta-llama/Llama-3.1-8B-Instruct", "generation_config": None,
           "hf_config": {"bos_token_id": None, "eos_token_id": None}}
    carry_forward(hub, source)
    assert hub == source  # everything taken over, the folder for the hub name

    own = tmp_path / "own_tokenizer"
    own.mkdir()
    ours = {"tokenizer": str(own), "generation_config": {"eos_token_id": 7},
            "hf_config": {"bos_token_id": 5, "eos_token_id": 7}}
    carry_forward(ours, source)
    assert ours == {"tokenizer": str(own), "generation_config": {"eos_token_id": 7},
                    "hf_config": {"bos_token_id": 5, "eos_token_id": 7, "pad_token_id": 128004}}

    names = {"tokenizer": "meta-llama/Llama-3.1-8B-Instruct", "hf_config": {}}
    carry_forward(names, {"tokenizer": "some/other-tokenizer", "hf_config": {}})  # two hub names: the recipe's
    assert names["tokenizer"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_checkpoint_saver_in_place_and_in_the_background(tmp_path, cpu_parallel_state):
    """The trainer's CheckpointSaver (megatron_ext/checkpoint_saver.py) on one rank, with a distributed optimizer
    saved fully_reshardable and keep_last 2. In place: each save is the latest at once, finalize is a no-op. In the
    background: a save with wait=False is not the latest until a finalize puts it in place, two pending saves go in
    place oldest first, a save with wait=True is in place when it returns, keep_last applies. Pins mutants: the
    background flag, wait inverted or not blocking, pending saves popped newest first, keep_last and
    optimizer_sharding not passed on, an in-place finalize touching the absent queue."""
    from megatron_ext.checkpoint_saver import CheckpointSaver

    model, ddp, opt, sched = setup(1, distributed_optimizer=True)
    step(ddp, opt, sched, 0)  # an optimizer state to save

    def saver(name, background):
        lines: list[str] = []
        return CheckpointSaver(tmp_path / name, keep_last=2, background=background, log=lines.append,
                               optimizer_sharding="fully_reshardable"), lines

    def save(s, iteration, wait=False):
        s.save(iteration, [model], optimizer=opt, scheduler=sched, metadata={"hf_config": TINY}, wait=wait)

    in_place, lines = saver("in_place", False)
    for iteration in (1, 2, 3):
        save(in_place, iteration)
        assert latest_iteration(in_place.root) == iteration
    in_place.finalize()
    assert sorted(p.name for p in in_place.root.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert read_metadata(in_place.root)["optimizer_sharding"] == "fully_reshardable"
    assert [line.split(" (")[0] for line in lines] == [f"[train] saved {in_place.root}/iter_000000{i}" for i in (1, 2, 3)]

    background, lines = saver("background", True)
    save(background, 1)
    assert latest_iteration(background.root) is None and [w[0] for w in background.writing] == [1]
    background.finalize(blocking=True)
    assert latest_iteration(background.root) == 1 and not background.writing
    save(background, 2)
    save(background, 3)
    background.finalize(blocking=True)
    assert latest_iteration(background.root) == 3
    save(background, 4, wait=True)
    assert latest_iteration(background.root) == 4 and not background.writing
    assert sorted(p.name for p in background.root.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert read_metadata(background.root)["optimizer_sharding"] == "fully_reshardable"
    assert [line.split(" (")[0] for line in lines] == [f"[train] saved {background.root}/iter_000000{i}"
                                                       for i in (1, 2, 3, 4)]
    assert all("in the background" in line for line in lines)


@pytest.mark.parametrize("background", [False, True], ids=["in_place", "background"])
def test_checkpoint_saver_says_a_full_disk_in_recipe_words(tmp_path, cpu_parallel_state, background):
    """A save that runs out of space (a full disk at the latest pointer: /dev/full under its temporary name) is one
    error naming checkpoint.dir, in place and, in the background, from the finalize that meets it. Pins mutants: the
    rewording dropped from save or from finalize."""
    from megatron_ext.checkpoint_saver import CheckpointSaver

    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    root = tmp_path / "ckpt"
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    saver = CheckpointSaver(root, keep_last=None, background=background, log=lambda line: None)
    saver.save(1, [model], optimizer=None, scheduler=None, metadata={"hf_config": TINY}, wait=True)
    (root / ".latest_checkpointed_iteration.txt.tmp").symlink_to("/dev/full")
    with pytest.raises(CheckpointError) as e:
        saver.save(2, [model], optimizer=None, scheduler=None, metadata={"hf_config": TINY}, wait=True)
    assert str(e.value).startswith(f"checkpoint.dir {root}: no space left on device while "), e.value
    assert str(e.value).endswith("; free space or move checkpoint.dir"), e.value
    assert getattr(e.value, "alike_on_every_rank", False) and latest_iteration(root) == 1
