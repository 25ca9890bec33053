"""Pins for megatron_ext/data/loaders.py that the data tests left open (mutation audit round 6). Oracles: Megatron
draws seq_length + 1 tokens per sample (the module docstring), and a blend names one weight per prefix."""

from __future__ import annotations

import pytest

from megatron_ext.data import DataError, build_cpt_datasets
from megatron_ext.data.dataset_files import read_manifest


def test_a_corpus_of_exactly_one_sequence_is_enough_and_one_token_less_is_not(tmp_path, token_data):
    """One sample needs seq_length + 1 tokens (tokens and the labels shifted by one): a corpus of exactly that many
    builds one sample; at one more seq_length the error counts the one token missing."""
    tokens = int(read_manifest(token_data, "cpt")["tokens"])
    train = build_cpt_datasets(token_data, tokens - 1, cache_dir=str(tmp_path / "a"))[0]
    assert len(train) == 1 and train[0]["tokens"].numel() == tokens - 1
    with pytest.raises(DataError, match=rf"{tokens} tokens, but one sequence of seq_length {tokens} needs "
                                        rf"{tokens + 1}: 1 tokens missing"):
        build_cpt_datasets(token_data, tokens, cache_dir=str(tmp_path / "b"))


def test_fewer_weights_than_prefixes_is_refused(token_data, second_token_data):
    """A blend of two prefixes given one weight is a mistake in the recipe, said as such (not left to
    Megatron-Core's blend parsing)."""
    with pytest.raises(DataError, match=r"data weights \[1\]: 1 weights for 2 prefixes"):
        build_cpt_datasets([token_data, second_token_data], 32, weights=[1], num_samples=(8, None, None))


def test_a_split_of_exactly_one_sequence_is_enough_and_one_token_less_is_not():
    """Each split of a positive weight needs seq_length + 1 tokens. Four documents of 5 tokens split "50,50,0":
    train and valid hold two documents, 10 tokens each, enough for seq_length 9 and one token short for 10."""
    import numpy as np

    from megatron_ext.data.loaders import _check_split_sizes

    lengths = np.array([5, 5, 5, 5], dtype=np.int64)
    _check_split_sizes("p", lengths, 9, "50,50,0")
    with pytest.raises(DataError, match=r"the train split of data prefix p holds 2 of 4 documents, 10 tokens, fewer "
                                        r"than one sequence of seq_length 10 needs \(11\)"):
        _check_split_sizes("p", lengths, 10, "50,50,0")


def test_a_single_conversation_left_out_is_warned_of(sft_data):
    """SFT conversations longer than seq_length are left out with a warning, even when it is only one."""
    import warnings

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data import SFTPackedDataset

    index = IndexedDataset(sft_data)  # kept: its lengths are a view of the index's memory map
    lengths = sorted(int(n) for n in index.sequence_lengths)
    assert lengths[-1] > lengths[-2]  # the fixture's longest conversation is the only one of its length
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = SFTPackedDataset(sft_data, lengths[-2])
    assert ds.dropped == 1
    assert [str(w.message) for w in caught if "left out" in str(w.message)] == [
        f"{sft_data}: 1 conversations longer than seq_length {lengths[-2]} left out"]


def test_a_cache_folder_that_cannot_be_made_is_said_as_such(tmp_path, token_data):
    """data.cache_dir below a file: the folder cannot be made, said before the builder starts (under torch.distributed
    rank 0 failing inside Megatron-Core's builder left the others in its barrier), with the fix."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataError, match=rf"data cache folder {blocker}/cache: cannot be made \(.*\); set "
                                        r"data.cache_dir to a folder this job can write"):
        build_cpt_datasets(token_data, 32, cache_dir=str(blocker / "cache"))


def test_sft_packing_follows_the_seed(sft_data):
    """Packing is deterministic in `seed` (the class docstring): the same seed packs alike, another seed otherwise
    (data.seed of a recipe must reach it, or every seed trains on the same packs)."""
    from megatron_ext.data import SFTPackedDataset

    a, b, c = (SFTPackedDataset(sft_data, 256, seed=s) for s in (1, 1, 2))
    assert a.packs == b.packs
    assert a.packs != c.packs
    assert sorted(i for p in a.packs for i in p) == sorted(i for p in c.packs for i in p)  # the same conversations
