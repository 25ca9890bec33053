"""CPT datasets under torch.distributed: rank 0 builds Megatron-Core's index caches, all ranks agree."""

import json

from megatron_ext.data import build_cpt_datasets, prepare_cpt, toy
from tests.conftest import ROOT

WORKER = ROOT / "tests/distributed/workers/data_gptdataset.py"


def test_two_ranks_see_identical_samples(tmp_path, torchrun):
    tok = toy.build_toy_tokenizer(tmp_path / "tok")
    for name, seed in (("a", 1), ("b", 2)):
        toy.write_jsonl(tmp_path / f"{name}.jsonl", toy.synthetic_corpus(10, seed=seed))
        prepare_cpt([str(tmp_path / f"{name}.jsonl")], str(tok), str(tmp_path / name), progress=False)
    out = tmp_path / "res"
    torchrun(WORKER, 2, "--prefix", str(tmp_path / "a"), "--prefix2", str(tmp_path / "b"),
             "--cache", str(tmp_path / "cache"), "--out", str(out))
    r0, r1 = (json.loads((tmp_path / f"res.{r}").read_text()) for r in (0, 1))
    assert r0 == r1
    assert r0["blend_len"] == 40 and set(r0["blend_source"]) == {0, 1}
    share = r0["blend_source"].count(0) / 40
    assert abs(share - 0.7) < 0.1  # Megatron's blend follows the weights
    assert any(f.endswith("shuffle_index.npy") for f in r0["cache_files"])
    # the same build in this (non-distributed) process reads the caches and yields the same samples
    train = build_cpt_datasets(str(tmp_path / "a"), 32, seed=3, cache_dir=str(tmp_path / "cache"))[0]
    assert [train[i]["tokens"].tolist() for i in range(0, len(train), 7)] == r0["single"]
    other = build_cpt_datasets(str(tmp_path / "a"), 32, seed=4, cache_dir=str(tmp_path / "cache4"))[0]
    assert [other[i]["tokens"].tolist() for i in range(0, len(other), 7)] != r0["single"]  # seed matters
