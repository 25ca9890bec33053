"""Each PREFIX.idx is hashed once per job, by rank 0: its sha256 names GPTDataset's index caches (and goes into the
checkpoint's data identity), and at 100B tokens an .idx is 1-2 GB, which every rank of 512 read to hash it (up to
128 GB off the shared file system at each start, once per node), and rank 0 twice or three times. The other ranks
get rank 0's value, so all name the same caches and see the same samples."""

import hashlib
import json
from pathlib import Path

from megatron_ext.data.dataset_files import index_fingerprint
from tests.conftest import ROOT

WORKER = ROOT / "tests/distributed/workers/data_index_hashes.py"


def test_rank_zero_alone_hashes_each_index_once(tmp_path, torchrun, token_data, second_token_data):
    out = tmp_path / "res"
    torchrun(WORKER, 2, "--prefix", token_data, "--prefix2", second_token_data, "--cache", str(tmp_path / "cache"),
             "--out", str(out))
    r0, r1 = (json.loads((tmp_path / f"res.{r}").read_text()) for r in (0, 1))
    assert r0["hashes"] == {token_data: 1, second_token_data: 1}, r0["hashes"]
    assert r1["hashes"] == {token_data: 0, second_token_data: 0}, r1["hashes"]
    assert (r0["single"], r0["blend"]) == (r1["single"], r1["blend"]) and len(r0["blend"]) == 40


def test_one_prefix_keeps_its_fingerprint(token_data, second_token_data):
    """One prefix: the sha256 of its .idx, as before (existing index caches stay valid; the data identity's
    idx_sha256); a blend: over each file's, in order."""
    files = [Path(p + ".idx").read_bytes() for p in (token_data, second_token_data)]
    assert index_fingerprint([token_data]) == "sha256:" + hashlib.sha256(files[0]).hexdigest()
    blend = index_fingerprint([token_data, second_token_data])
    assert blend != index_fingerprint([second_token_data, token_data])
    assert blend not in (index_fingerprint([token_data]), index_fingerprint([second_token_data]))
