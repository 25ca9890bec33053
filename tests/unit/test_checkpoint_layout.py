"""The latest pointer of a checkpoint folder (checkpoint_layout.latest_iteration), read before every resume."""

from __future__ import annotations

import pytest

from megatron_ext.checkpoint_index import CheckpointError
from megatron_ext.checkpoint_layout import LATEST_FILE, latest_iteration


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x00", b"12\xe9\n"])
def test_a_pointer_of_bytes_that_are_not_text_is_one_checkpoint_error(tmp_path, content):
    """A torn write or a disk fault leaves bytes that are not UTF-8: the same one-line CheckpointError as 'abc'
    (naming the file and the fix), which a resume raises on every rank alike. It was a UnicodeDecodeError:
    a traceback on rank 0, 'rank 0: UnicodeDecodeError: ...' on the others."""
    (tmp_path / LATEST_FILE).write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"{LATEST_FILE}: expected an iteration number, found .*; fix or "
                                              "delete the file"):
        latest_iteration(tmp_path)
    (tmp_path / LATEST_FILE).write_bytes(b"12\n")
    assert latest_iteration(tmp_path) == 12
