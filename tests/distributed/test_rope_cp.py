"""CP-local RoPE on real gloo context-parallel groups of 4 and 2 processes."""

from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/rope_cp.py"


def test_cp_local_rope_tables_on_real_groups(tmp_path, torchrun):
    torchrun(WORKER, 4, "--out", str(tmp_path / "rope_cp.json"))
    results = read_json(tmp_path / "rope_cp.json")
    assert [r["cp"] for r in results] == [4, 2]
    for r in results:
        assert r["megatron_slice"] and r["rebuilds_cp1"] and r["local_length"], r
