"""A Ctrl-C once a tool's outcome is said, while Python exits (torch's and Megatron-Core's teardown take a second),
ended a complete run with a KeyboardInterrupt traceback or status -2. Each tool's script ignores interrupts after
main() returns (not main() itself: tests call it in-process, and a test session that ignored SIGINT and SIGTERM
would pass that on to every process it starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.data import toy
from tests.held_tool import ctrl_c_in_the_exit
from tests.unit.test_convert_fixtures import make_hf_model
from tests.unit.test_evaluate import save_tiny


@pytest.mark.parametrize("tool", ["prepare_data.py", "niah.py", "convert.py"])
def test_ctrl_c_after_the_outcome_changes_nothing(tool, tmp_path):
    """Control (old scripts): a KeyboardInterrupt traceback, exit 1 (prepare_data), -2 (niah, convert)."""
    out = tmp_path / "out"
    if tool == "prepare_data.py":
        toy.write_toy_inputs(tmp_path / "toy", documents=20, chats=2, seed=1)
        argv = ["cpt", "--input", tmp_path / "toy" / "corpus.jsonl", "--tokenizer", tmp_path / "toy" / "tokenizer",
                "--output", out, "--quiet"]
        made = Path(f"{out}.bin")
    elif tool == "niah.py":
        argv = ["--model", save_tiny(tmp_path / "hf"), "--lengths", "64", "--depths", "50", "--no-progress", "--out",
                out]
        made = out / "results.json"
    else:
        argv = ["to-megatron", "--hf", make_hf_model(tmp_path / "hf"), "--out", out, "--no-progress"]
        made = out / "latest_checkpointed_iteration.txt"
    code, err = ctrl_c_in_the_exit(tool, argv)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert made.is_file()
