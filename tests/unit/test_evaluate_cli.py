"""tools/niah.py: argument parsing, clear one-line errors, and end-to-end runs on a tiny HF checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate.cli import main, parse_depths, parse_lengths
from tests.unit.test_evaluate import assert_png, one_thread, tiny_dir  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]


def test_parse_lengths():
    assert parse_lengths("1K,4096,1M") == [1024, 4096, 1 << 20]
    assert parse_lengths("4M") == [4_194_304]  # the paper's 4M token limit
    assert parse_lengths("1.5K,2k") == [1536, 2048]
    assert parse_lengths("1K:1M:11") == [1 << k for k in range(10, 21)]
    assert parse_lengths("1K:4K:2,1K") == [1024, 4096]
    for bad, msg in [("abc", "not a token count"), ("0", "positive"), ("-5", "not a token count"),
                     ("1.3", "whole number"), ("4K:1K:3", "ends at or below"), ("1K:4K:1", "COUNT >= 2"),
                     ("1K:4K", "START:END:COUNT"),
                     ("4K:4K:3", "ends at or below")]:  # an empty range (mutation audit round 3: hi < lo allowed it)
        with pytest.raises(EvalError, match=msg):
            parse_lengths(bad)


def test_parse_depths():
    assert parse_depths("0:100:10") == [float(d) for d in range(0, 101, 10)]
    assert parse_depths("50,0,100") == [0.0, 50.0, 100.0]
    assert parse_depths("0:100:33.3") == [0.0, 33.3, 66.6, 99.9]
    for bad, msg in [("0,150", "outside 0..100"), ("-10:100:10", "outside 0..100"), ("a,b", "not a list"),
                     ("0:100:0", "STEP > 0"),
                     ("0,100.5", "outside 0..100")]:  # just past the end (mutation audit round 3: <= 101 took it)
        with pytest.raises(EvalError, match=msg):
            parse_depths(bad)


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: "), e.value.code
    assert "\n" not in e.value.code  # one line
    return e.value.code


def test_cli_errors_are_one_clear_line(tiny_dir, tmp_path, capsys):
    out = ["--out", str(tmp_path / "o"), "--no-progress"]
    assert "does not exist" in _error(["--model", str(tmp_path / "nope")] + out, capsys)
    assert "no config.json" in _error(["--model", str(tmp_path)] + out, capsys)
    assert "not a token count" in _error(["--model", str(tiny_dir), "--lengths", "12Q"] + out, capsys)
    assert "outside 0..100" in _error(["--model", str(tiny_dir), "--depths", "0,101"] + out, capsys)
    assert "--haystack" in _error(["--model", str(tiny_dir), "--haystack", str(tmp_path / "x.txt")] + out, capsys)
    msg = _error(["--model", str(tiny_dir), "--lengths", "1K,2K"] + out, capsys)
    assert "max_position_embeddings=256" in msg and "--force" in msg
    assert "warning: lengths [1024, 2048] exceed" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("The old river passes the garden. " * 5)
    msg = _error(["--model", str(tiny_dir), "--haystack", str(short), "--lengths", "256"] + out, capsys)
    assert "short by" in msg and "omit --haystack" in msg
    msg = _error(["--megatron", str(tmp_path)] + out, capsys)
    # said before converting, without "convert it first with tools/convert.py to-hf", which fails the same way
    assert "it is not a Megatron checkpoint root" in msg and "convert it first" not in msg, msg
    assert "does not exist" in _error(["ppl", "--model", str(tiny_dir), "--text", str(tmp_path / "no.txt")] + out,
                                      capsys)
    assert "prepare_data" in _error(["ppl", "--model", str(tiny_dir), "--indexed", str(tmp_path / "d")] + out, capsys)
    assert not (tmp_path / "o" / "results.json").exists()


def test_cli_niah_and_ppl_end_to_end(tiny_dir, tmp_path, capsys):
    out = tmp_path / "niah"
    assert main(["--model", str(tiny_dir), "--lengths", "64,128,512", "--depths", "0:100:50", "--out", str(out),
                 "--max-new-tokens", "4", "--no-progress"]) == 0
    text = capsys.readouterr()
    assert "memory note: KV cache 512 B/token (2 x 2 layers x 2 KV heads x 16 head_dim x 4 bytes)" in text.out
    assert "warning: lengths [512] exceed" in text.err
    res = json.loads((out / "results.json").read_text())
    assert res["lengths"] == [64, 128, 512] and res["depths"] == [0.0, 50.0, 100.0]
    assert res["skipped_lengths"] == [512] and len(res["cells"]) == 6
    assert_png(out / "heatmap.png")
    assert main(["--model", str(tiny_dir), "--lengths", "512", "--depths", "50", "--force", "--out", str(out),
                 "--max-new-tokens", "2", "--no-progress"]) == 0
    assert json.loads((out / "results.json").read_text())["skipped_lengths"] == []  # --force ran it
    doc = tmp_path / "doc.txt"
    doc.write_text("The old river passes the garden near the hill. " * 40)
    assert main(["ppl", "--model", str(tiny_dir), "--text", str(doc), "--out", str(tmp_path / "ppl"),
                 "--chunk", "32", "--no-progress"]) == 0
    ppl = json.loads((tmp_path / "ppl" / "ppl.json").read_text())
    assert ppl["doc_tokens"] == [256] and sum(b["tokens"] for b in ppl["buckets"]) == 255
    assert_png(tmp_path / "ppl" / "ppl.png")


def test_tool_script_fails_cleanly(tiny_dir, tmp_path):
    """The script itself (the in-process tests above cover the runs): exit status 1, one line, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "niah.py"), "--model", str(tiny_dir), "--depths",
                          "0,200", "--out", "o"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["error: --depths: [200.0] are outside 0..100 (depth is the needle's "
                                               "position in percent of the haystack)"]
    assert not (tmp_path / "o").exists()


def test_ppl_seq_len_beyond_the_trained_positions_is_evaluated(tiny_dir, tmp_path):
    """`ppl --seq-len N` above max_position_embeddings (256 here) measures the loss out to N tokens (the point of
    evaluating extrapolation): the documents are cut at N, not at the model's positions. Oracle: the document's
    token count from its tokenizer, min(that, 384). Mutation audit round 3 (the CLI cut them at
    max_position_embeddings before the run, whatever --seq-len said)."""
    from transformers import AutoTokenizer

    doc = tmp_path / "doc.txt"
    doc.write_text("The old river passes the garden near the hill. " * 80)
    n = len(AutoTokenizer.from_pretrained(tiny_dir)(doc.read_text())["input_ids"])
    assert n > 384
    assert main(["ppl", "--model", str(tiny_dir), "--text", str(doc), "--seq-len", "384", "--out",
                 str(tmp_path / "ppl"), "--chunk", "64", "--no-progress"]) == 0
    ppl = json.loads((tmp_path / "ppl" / "ppl.json").read_text())
    assert ppl["doc_tokens"] == [384] and sum(b["tokens"] for b in ppl["buckets"]) == 383
