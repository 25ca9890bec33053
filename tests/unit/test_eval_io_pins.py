"""megatron_ext.evaluate.io beyond what the CLI tests reach (mutation audit round 7): write_atomic's temporary
file sits beside the target (a rename across file systems fails), is removed on an interrupt too, the error keeps
its errno (callers tell a full disk) and names the file; model_version tells two saves apart; read_utf8 names the
byte; not_there says what is there instead."""

import errno
import json
import os

import pytest

from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate.io import (OutputWriteError, check_writable_folder, model_version, not_there, read_utf8,
                                      write_atomic, write_json_atomic)


def test_the_target_folders_are_made(tmp_path):
    target = tmp_path / "a" / "b" / "results.json"  # folders that do not exist yet
    assert write_atomic(target, lambda f: f.write("x")) == target and target.read_text() == "x"
    assert os.listdir(target.parent) == ["results.json"]


def test_the_temporary_file_is_made_in_the_targets_folder(tmp_path):
    """Beside the target, so the rename stays in one file system (from /tmp to a cluster's disk it fails, EXDEV)."""
    target = tmp_path / "results.json"
    during = []
    write_atomic(target, lambda f: (during.extend(os.listdir(tmp_path)), f.write("x")))
    assert len(during) == 1 and during[0].startswith(".results.json.") and during[0].endswith(".tmp")


def test_an_interrupt_while_writing_leaves_the_old_file_and_no_temporary(tmp_path):
    target = write_json_atomic(tmp_path / "results.json", {"good": 1})

    def interrupted(f):
        f.write("{\"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, interrupted)
    assert os.listdir(tmp_path) == ["results.json"] and json.loads(target.read_text()) == {"good": 1}


def test_a_failed_write_keeps_its_errno_and_names_the_file(tmp_path):
    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputWriteError) as e:
        write_atomic(tmp_path / "o" / "results.json", full)
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert str(e.value) == f"cannot write {tmp_path / 'o' / 'results.json'} (No space left on device)"
    assert os.listdir(tmp_path / "o") == []
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputWriteError, match=f"cannot create results.json in the folder {tmp_path / 'f'} "):
        write_atomic(tmp_path / "f" / "results.json", lambda f: f.write("x"))


def test_results_json_is_indented_and_ends_with_a_newline(tmp_path):
    text = write_json_atomic(tmp_path / "r.json", {"a": [1]}).read_text()
    assert text == json.dumps({"a": [1]}, indent=2) + "\n"


def test_check_writable_folder_names_the_flag(tmp_path):
    check_writable_folder(None, "--out")  # no output: nothing to check
    check_writable_folder(tmp_path / "new", "--out")
    (tmp_path / "f").write_text("")
    with pytest.raises(EvalError, match=f"^--out {tmp_path / 'f' / 'o'}: "):
        check_writable_folder(tmp_path / "f" / "o", "--out")


def test_model_version_tells_two_saves_apart(tmp_path):
    """An HF folder's version: each weight file (safetensors and .bin) with its size and modification time, so a
    save of the same size over the old one is another version; an empty or missing folder has none."""
    assert model_version(tmp_path) is None and model_version(tmp_path / "missing") is None
    w, b = tmp_path / "model.safetensors", tmp_path / "pytorch_model.bin"
    w.write_bytes(b"1234")
    b.write_bytes(b"12")
    os.utime(w, ns=(10**18, 10**18))
    os.utime(b, ns=(10**18, 10**18))
    assert model_version(tmp_path) == (f"model.safetensors 4 B {10**18}; pytorch_model.bin 2 B {10**18}")
    first = model_version(tmp_path)
    os.utime(w, ns=(10**18 + 1, 10**18 + 1))  # saved again, same size
    assert model_version(tmp_path) != first


def test_model_version_of_a_folder_that_cannot_be_listed_is_none(tmp_path):
    """An OSError while looking (here a weight file that is a link to nowhere) is 'unknown', not a traceback."""
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "gone")
    assert model_version(tmp_path) is None


def test_read_utf8_names_the_byte(tmp_path):
    p = tmp_path / "h.txt"
    p.write_bytes(b"abc\xffdef")
    with pytest.raises(EvalError, match=rf"^--haystack {p}: not UTF-8 text \(invalid start byte at byte 3\); "):
        read_utf8(p, "--haystack")


def test_not_there_says_what_is_there(tmp_path):
    (tmp_path / "f").write_text("")
    assert not_there(tmp_path / "x") == not_there(tmp_path / "x", "folder") == "does not exist"
    assert not_there(tmp_path) == "is a folder, not a file"
    assert not_there(tmp_path / "f", "folder") == "is a file, not a folder"
