"""Which samples each rank reads at each step, and where a resumed run goes on in its data."""

import pytest

from megatron_ext.recipe import load_recipe
from megatron_ext.resume import resume_position
from megatron_ext.training_data import TrainBatches
from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"


def _recipe(token_data, *overrides):
    return load_recipe(RECIPE, [f"data.prefix={token_data}", "checkpoint.dir=/tmp/unused", "train.seq_length=256",
                                "train.steps=8", "parallel.context=1", *overrides])


def _ids(batches, step, dp_size, microbatches):
    return [i for m in range(microbatches) for d in range(dp_size)
            for i in TrainBatches.sample_ids(_rank(batches, d), step, m)]


def _rank(batches, d):
    import copy

    other = copy.copy(batches)
    other.dp_rank = d
    return other


def test_every_sample_read_once_in_order_on_any_layout(token_data):
    recipe = _recipe(token_data, "train.global_batch_size=4")
    one = TrainBatches(recipe, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    two = TrainBatches(recipe, dp_rank=0, dp_size=2, cp_rank=0, cp_size=1)
    for step in range(3):
        assert _ids(one, step, 1, 4) == list(range(4 * step, 4 * step + 4))
        assert sorted(_ids(two, step, 2, 2)) == list(range(4 * step, 4 * step + 4))


def test_after_a_batch_change_the_run_goes_on_where_it_stopped(token_data):
    """Resumed at step 2 after 8 samples, with a global batch of 2: samples 8, 9, then 10, 11."""
    resumed = TrainBatches(_recipe(token_data, "train.global_batch_size=2"), dp_rank=0, dp_size=1, cp_rank=0,
                           cp_size=1, first_step=2, consumed_samples=8)
    assert _ids(resumed, 2, 1, 2) == [8, 9] and _ids(resumed, 3, 1, 2) == [10, 11]
    assert resumed.samples_before(4) == 12
    plain = TrainBatches(_recipe(token_data, "train.global_batch_size=2"), dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    assert _ids(plain, 2, 1, 2) == [4, 5]  # control: step x batch would read samples already seen


@pytest.mark.parametrize("saved, expect", [
    # counts recorded by the checkpoint
    ({"consumed_samples": 12, "tokens": 3072, "recipe": {"train": {"global_batch_size": 4}}}, (12, 3072, [])),
    # an older checkpoint: counted at its own global batch and sequence length
    ({"recipe": {"train": {"global_batch_size": 4, "seq_length": 512}}}, (12, 12 * 512,
                                                                          ["train.seq_length: 512 -> 256"])),
    ({}, (6, 6 * 256, [])),  # nothing recorded: the current recipe's numbers
])
def test_resume_position(token_data, saved, expect):
    recipe = _recipe(token_data, "train.global_batch_size=2")
    assert resume_position(saved, 3, recipe) == expect


def test_resume_position_names_changed_data_settings(token_data):
    recipe = _recipe(token_data, "train.global_batch_size=2", "train.seed=7")
    saved = {"consumed_samples": 8, "tokens": 2048,
             "recipe": {**recipe.to_dict(), "data": {**recipe.to_dict()["data"], "prefix": "/old/cpt"}}}
    saved["recipe"]["train"] = {**saved["recipe"]["train"], "seed": 1}
    _, _, changed = resume_position(saved, 4, recipe)
    assert changed == [f"data.prefix: '/old/cpt' -> {token_data!r}", "train.seed: 1 -> 7"]


def test_another_spelling_of_the_same_data_prefix_is_no_change(token_data, tmp_path, monkeypatch):
    """Relative vs absolute path, or a symlink, to the same indexed dataset: no warning; another dataset: one."""
    import os
    import shutil
    from pathlib import Path

    recipe = _recipe(token_data, "train.global_batch_size=2")
    saved = {"consumed_samples": 8, "tokens": 2048, "recipe": recipe.to_dict()}
    data = Path(token_data)
    monkeypatch.chdir(data.parent)
    relative = _recipe(f"./{data.name}", "train.global_batch_size=2")
    (tmp_path / "link.bin").symlink_to(data.with_name(data.name + ".bin"))
    (tmp_path / "link.idx").symlink_to(data.with_name(data.name + ".idx"))
    linked = _recipe(str(tmp_path / "link"), "train.global_batch_size=2")
    for other in (relative, linked):
        assert resume_position(saved, 4, other)[2] == []
    for suffix in (".bin", ".idx"):  # control: a copy is another dataset as far as the check knows
        shutil.copy(data.with_name(data.name + suffix), tmp_path / f"copy{suffix}")
    copied = _recipe(str(tmp_path / "copy"), "train.global_batch_size=2")
    assert resume_position(saved, 4, copied)[2] == [f"data.prefix: {token_data!r} -> {str(tmp_path / 'copy')!r}"]
    assert os.path.samefile(relative.data.prefix + ".bin", token_data + ".bin")


def _prepare(prefix, tokenizer, documents, seed=0):
    """`prepare_data.py cpt --force` of `documents` synthetic documents into PREFIX (the corpus file named by its
    contents, so preparing the same again reads the same file)."""
    from megatron_ext.data import prepare_cpt
    from megatron_ext.data.toy import synthetic_corpus, write_jsonl

    corpus = write_jsonl(f"{prefix}_{documents}_{seed}.jsonl", synthetic_corpus(documents, seed=seed))
    prepare_cpt([str(corpus)], tokenizer, prefix, force=True, progress=False)


def _checkpoint_of(prefix: str, tokenizer) -> tuple:
    """(recipe, checkpoint metadata) of a run on 20 documents prepared at `prefix`, 8 samples in."""
    from megatron_ext.resume import data_identities

    _prepare(prefix, tokenizer, 20)
    recipe = _recipe(prefix, "train.global_batch_size=2")
    return recipe, {"consumed_samples": 8, "tokens": 2048, "recipe": recipe.to_dict(),
                    "data_identity": data_identities(recipe)}


def test_data_prepared_again_under_the_same_prefix_is_named(tmp_path, toy_tokenizer):
    """The checkpoint records each prefix's contents (megatron_ext.data.dataset_files.data_identity): other documents
    under the same data.prefix are a data change; the same documents prepared again (new files) are none."""
    import os

    from megatron_ext.data.dataset_files import data_identity
    from megatron_ext.resume import plan_resume

    prefix = str(tmp_path / "cpt")
    recipe, saved = _checkpoint_of(prefix, toy_tokenizer)
    old = saved["data_identity"][prefix]
    assert old["documents"] == 20 and old == data_identity(prefix)
    inode = os.stat(prefix + ".idx").st_ino
    _prepare(prefix, toy_tokenizer, 20)  # the same documents again: new files, the same contents
    assert os.stat(prefix + ".idx").st_ino != inode and resume_position(saved, 4, recipe)[2] == []
    _prepare(prefix, toy_tokenizer, 30)
    new = data_identity(prefix)
    expect = (f"data.prefix {prefix}: contents changed (20 documents, {old['tokens']:,} tokens -> 30 documents, "
              f"{new['tokens']:,} tokens; {prefix}.bin/.idx prepared again? restore the checkpoint's data to read "
              "on in its order)")
    assert resume_position(saved, 4, recipe)[2] == [expect]
    assert plan_resume(saved, 4, recipe, 1).data_changed == [expect]  # the trainer's and the info tool's decision
    assert plan_resume(saved, 4, recipe, 1, data_now={}).data_changed == []  # what other ranks than 0 pass
    no_record = {k: v for k, v in saved.items() if k != "data_identity"}  # a checkpoint from before: no warning
    assert resume_position(no_record, 4, recipe)[2] == []
    # an identity recorded without the tokenizer's hash (an older version): the counts changed, and no other
    # tokenizer is claimed, which nothing shows
    assert "tokenizer_hash" in old and new["tokenizer_hash"] is not None
    older = {**saved, "data_identity": {prefix: {k: v for k, v in old.items() if k != "tokenizer_hash"}}}
    assert resume_position(older, 4, recipe)[2] == [expect]
    assert data_identity(str(tmp_path / "gone")) is None  # unreadable data: nothing recorded or compared


def test_data_moved_with_its_contents_is_the_same_data(tmp_path, token_data, second_token_data, toy_tokenizer):
    """A copy at another path with the recorded contents reads in the same order (GPTDataset orders by contents
    and seed): no warning. Of a blend, only the prefix prepared again is named."""
    import shutil

    from megatron_ext.resume import data_identities

    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(token_data + suffix, tmp_path / f"moved{suffix}")
    recipe = _recipe(token_data, "train.global_batch_size=2")
    saved = {"consumed_samples": 8, "tokens": 2048, "recipe": recipe.to_dict(),
             "data_identity": data_identities(recipe)}
    moved = _recipe(str(tmp_path / "moved"), "train.global_batch_size=2")
    assert resume_position(saved, 4, moved)[2] == []
    shutil.copy(second_token_data + ".idx", tmp_path / "moved.idx")  # control: another dataset at the new path
    assert resume_position(saved, 4, moved)[2] == [f"data.prefix: {token_data!r} -> {str(tmp_path / 'moved')!r}"]

    mine = str(tmp_path / "mine")
    _prepare(mine, toy_tokenizer, 20)
    blend = _recipe(f"[{token_data}, {mine}]", "train.global_batch_size=2", "data.weights=[1, 1]")
    saved = {**saved, "recipe": blend.to_dict(), "data_identity": data_identities(blend)}
    _prepare(mine, toy_tokenizer, 20, seed=1)
    changed = resume_position(saved, 4, blend)[2]
    assert len(changed) == 1 and changed[0].startswith(f"data.prefix {mine}: contents changed (20 documents, ")


def test_other_tokens_of_the_same_lengths_are_named(tmp_path, toy_tokenizer):
    """Tokens rewritten with every document's length kept (a corpus packed into fixed-length documents, another
    shuffle of equal lengths): the same .idx, .bin size and tokenizer; the sampled .bin fingerprint tells them."""
    from pathlib import Path

    import numpy as np

    from megatron_ext.data.dataset_files import data_identity, read_manifest

    prefix = str(tmp_path / "cpt")
    recipe, saved = _checkpoint_of(prefix, toy_tokenizer)
    old = saved["data_identity"][prefix]
    before = {p: {k: v for k, v in identity.items() if k != "bin_sample_sha256"}
              for p, identity in saved["data_identity"].items()}
    legacy = {**saved, "data_identity": before}  # a checkpoint from before the sampled fingerprint
    assert resume_position(legacy, 4, recipe)[2] == []

    bin_file = Path(prefix + ".bin")
    tokens = np.fromfile(bin_file, dtype=read_manifest(prefix)["dtype"])
    np.roll(tokens, 1).tofile(bin_file)
    new = data_identity(prefix)
    assert {k: v for k, v in new.items() if k != "bin_sample_sha256"} == before[prefix]  # only the sample tells
    expect = (f"data.prefix {prefix}: contents changed (20 documents, {old['tokens']:,} tokens -> 20 documents, "
              f"{old['tokens']:,} tokens; {prefix}.bin/.idx prepared again? restore the checkpoint's data to read "
              "on in its order)")
    assert resume_position(saved, 4, recipe)[2] == [expect]


def test_sampled_fingerprint_reads_spaced_blocks(tmp_path):
    """`sampled_fingerprint` on small files with tiny blocks (3 of 16 bytes) where the defaults (64 of 64 KiB)
    would read them whole: the contents decide, not the path; a byte outside the sampled blocks is not seen."""
    import hashlib

    import numpy as np

    from megatron_ext.data.dataset_files import sample_offsets, sampled_fingerprint

    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    (tmp_path / "sub").mkdir()
    a, b, c = tmp_path / "a.bin", tmp_path / "sub" / "b.bin", tmp_path / "c.bin"
    a.write_bytes(data)
    b.write_bytes(data)
    assert sampled_fingerprint(a) == sampled_fingerprint(b)
    assert sampled_fingerprint(a, 3, 16) == sampled_fingerprint(b, 3, 16)
    whole = "sha256:" + hashlib.sha256(len(data).to_bytes(8, "little") + data).hexdigest()
    assert sampled_fingerprint(a) == whole  # under 64 x 64 KiB: hashed whole
    assert sample_offsets(48, 3, 16) == [0, 16, 32]  # exactly the sampled total: whole too

    assert sample_offsets(1000, 3, 16) == [0, 492, 984]  # first, middle, last block
    base = sampled_fingerprint(a, 3, 16)

    def flipped(i: int) -> str:
        c.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
        return sampled_fingerprint(c, 3, 16)

    assert all(flipped(i) != base for i in (0, 15, 492, 507, 984, 999))
    assert all(flipped(i) == base for i in (16, 491, 508, 983))  # the limit: bytes between blocks go unseen

    c.write_bytes(b"AAAAzzBBBB")  # the same two blocks in a file one byte longer: the size tells them
    b.write_bytes(b"AAAAzzzBBBB")
    assert sampled_fingerprint(c, 2, 4) != sampled_fingerprint(b, 2, 4)

    terabyte = sample_offsets(1 << 40)  # what a start reads of a 1 TiB .bin: 64 blocks of 64 KiB, 4 MiB
    assert len(terabyte) == 64 and terabyte[0] == 0 and terabyte[-1] == (1 << 40) - (1 << 16)
    assert min(np.diff(terabyte)) >= 1 << 16


def test_sft_goes_round_its_packs_in_a_new_order_each_pass(sft_data):
    """Before, every pass over the packs read the same batches in the same order (recipes/sft.yaml goes round its
    ~13K packs about 8 times). The first pass keeps the packs' order; each later one is a permutation of its own,
    the same in a resumed run."""
    recipe = load_recipe(ROOT / "recipes/tiny/sft.yaml", [f"data.prefix={sft_data}", "checkpoint.dir=/tmp/unused",
                                                          "train.global_batch_size=2", "train.steps=40"])
    batches = TrainBatches(recipe, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    n = len(batches.dataset)
    order = [batches.pack_of(i) for i in range(3 * n)]
    first, second, third = order[:n], order[n:2 * n], order[2 * n:]
    assert first == list(range(n)) and sorted(second) == sorted(third) == first
    assert second != first and third != second
    assert [b for s in range(3) for m in range(2) for b in batches.sample_ids(s, m)] == order[:6]
    resumed = TrainBatches(recipe, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1, first_step=n // 2 + 1,
                           consumed_samples=2 * (n // 2 + 1))
    assert resumed.sample_ids(n // 2 + 1, 0) == [order[2 * (n // 2 + 1)]]
    assert resumed.sample_ids(n, 1) == [order[2 * n + 1]]
    convs = sum(len(p) for p in batches.dataset.packs)
    assert batches.passes(40) == (f"{n:,} packs of {convs:,} conversations; 80 packs read over the run: {80 / n:.2f} "
                                  f"passes over the data (each after the first in a new order), ~{2 * convs / n:,.0f} "
                                  "conversations per step")


def test_an_sft_microbatch_confines_attention_to_each_conversation(sft_data):
    """One pack per microbatch as a THD sequence: cu_seqlens are the pack's conversation bounds, max_seqlen the
    longest conversation's length, and attention_pairs (the FLOP count's) the causal (query, key) pairs within each
    conversation, counted here one by one: L (L + 1) / 2 each, the padding tail included."""
    recipe = load_recipe(ROOT / "recipes/tiny/sft.yaml", [f"data.prefix={sft_data}", "checkpoint.dir=/tmp/unused",
                                                          "train.global_batch_size=2", "train.steps=4"])
    batches = TrainBatches(recipe, dp_rank=1, dp_size=2, cp_rank=0, cp_size=1)
    (pack,) = batches.sample_ids(1, 0)  # step 1, DP rank 1: sample 3
    assert pack == 3
    row = batches.dataset[pack]
    batch = batches.microbatch(1, 0)
    bounds = [int(b) for b in row["cu_seqlens"]]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    assert len(lengths) >= 2 and len(set(lengths)) >= 2  # a pack of conversations of other lengths: a real check
    assert sum(lengths) == recipe.train.seq_length
    params = batch["packed_seq_params"]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == bounds
    assert params.max_seqlen_q == params.max_seqlen_kv == max(lengths)
    assert batch["attention_pairs"] == sum(1 for n in lengths for q in range(n) for k in range(q + 1))
    assert batch["tokens"].shape == (1, recipe.train.seq_length)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert batch[key][0].tolist() == list(row[key]), key
