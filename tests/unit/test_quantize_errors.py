"""tools/quantize.py: user mistakes and signals end in one `error: ...` line, not a traceback.

Each ended otherwise: an unwritable --out in a FileNotFoundError at the export, after the calibration; calibration
text that is not UTF-8 in a UnicodeDecodeError, a non-string "text" in the tokenizer's ValueError; --calib-seq-length
0 ran with the default; Ctrl-C and SIGTERM in a traceback (SIGTERM exited 1).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("modelopt.torch.quantization")

from megatron_ext.quantize.cli import main  # noqa: E402
from megatron_ext.runtime.signals import Terminated  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.held_tool import signalled_at_import  # noqa: E402
from tests.unit.test_evaluate import save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_hf"))


def _words(n: int) -> str:
    from megatron_ext.evaluate.haystack import filler_words

    words = filler_words()  # the tiny tokenizer's vocabulary: one token each
    return " ".join(words[i % len(words)] for i in range(n))


def _main(argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of main in this process; an interrupt that leaves it (the traceback users saw) fails
    the test, where it would end pytest's run."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            return main(argv), err.getvalue()
    except KeyboardInterrupt as e:
        pytest.fail(f"{type(e).__name__} escaped main: a traceback")


def _fails(*argv) -> str:
    """The one error line of a run that must fail as a user mistake (status 2)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    return errors[0]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where nothing can be created")
def test_an_unwritable_out_is_found_before_the_calibration(tiny_dir, tmp_path, monkeypatch):
    import megatron_ext.quantize.fp8 as fp8

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(fp8, "load_model", no_load)
    (tmp_path / "c.txt").write_text(_words(200))
    assert _fails("--hf", tiny_dir, "--out", "/proc/x", "--calib", tmp_path / "c.txt", "--calib-seq-length", 32) == (
        "error: --out /proc/x: cannot create a folder there (No such file or directory in /proc); choose a "
        "writable path")


@pytest.mark.parametrize("length", [0, 1, -5])
def test_calib_seq_length_below_two_is_refused(length, tiny_dir, tmp_path):
    (tmp_path / "c.txt").write_text(_words(200))
    assert _fails("--hf", tiny_dir, "--out", tmp_path / "o", "--calib", tmp_path / "c.txt", "--calib-seq-length",
                  length).startswith(f"error: --calib-seq-length {length}: tokens per calibration window, a number "
                                     ">= 2")


def test_calib_samples_below_one_is_refused(tiny_dir, tmp_path):
    (tmp_path / "c.txt").write_text(_words(200))
    assert _fails("--hf", tiny_dir, "--out", tmp_path / "o", "--calib", tmp_path / "c.txt", "--calib-samples",
                  0).startswith("error: --calib-samples 0: the calibration windows, a number >= 1")


def _calib_file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name, data, expected", [
    ("c.txt", b"good text\nsecond line caf\xe9 ok\n", "c.txt:2: not UTF-8 text (invalid continuation byte at "
                                                     "byte 16 of the line); save the file as UTF-8"),
    ("c.jsonl", b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n', "c.jsonl:3: not UTF-8 text (invalid continuation "
                                                             "byte at byte 14 of the line); save the file as UTF-8"),
    ("c.jsonl", b'{"text": "fine"}\n{"text": 5}\n', 'c.jsonl:2: "text" is int 5, not a string: give each line\'s '
                                                    '"text" as a JSON string'),
    ("c.jsonl", b'{"text": "fine"}\n{"text": ["a", "b"]}\n', 'c.jsonl:2: "text" is list ["a", "b"], not a string'),
])
def test_bad_calibration_text_names_the_file_and_line(name, data, expected, tiny_dir, tmp_path):
    calib = _calib_file(tmp_path, name, data)
    line = _fails("--hf", tiny_dir, "--out", tmp_path / "o", "--calib", calib, "--calib-samples", 1,
                  "--calib-seq-length", 4)
    assert line.startswith(f"error: {tmp_path / expected}"), line
    assert not (tmp_path / "o").exists()


def test_ctrl_c_in_the_calibration_is_one_line_and_130(tiny_dir, tmp_path, monkeypatch):
    import megatron_ext.quantize.fp8 as fp8

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fp8, "quantize", interrupted)
    (tmp_path / "c.txt").write_text(_words(200))
    code, err = _main(["--hf", str(tiny_dir), "--out", str(tmp_path / "o"), "--calib", str(tmp_path / "c.txt"),
                       "--calib-samples", "2", "--calib-seq-length", "32"])
    assert code == 130 and err.strip().splitlines()[-1] == (
        f"error: interrupted (Ctrl-C); nothing was written (--out {tmp_path / 'o'} is written only by a complete "
        "run): run it again"), err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_sigterm_in_the_calibration_is_one_line_and_143(tiny_dir, tmp_path):
    """The real signal, to the tool's own process: what scancel and a Slurm time limit send."""
    calib = tmp_path / "c.jsonl"
    # enough windows that the calibration still runs when the signal comes
    calib.write_text("".join(json.dumps({"text": _words(2000)}) + "\n" for _ in range(100)))
    log_path = tmp_path / "output.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tools/quantize.py"), "--hf", str(tiny_dir), "--out",
                                 str(tmp_path / "o"), "--calib", str(calib), "--calib-samples", "500",
                                 "--calib-seq-length", "256"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.time() + 180
    try:
        while "[quantize] ModelOpt" not in log_path.read_text():
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log_path.read_text()
    finally:
        proc.kill()  # a failed test leaves no calibration running
    output = log_path.read_text()
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in output and errors == [output.strip().splitlines()[-1]], output
    assert errors[0].startswith("error: interrupted (SIGTERM); nothing was written")
    assert sorted(tmp_path.iterdir()) == sorted([calib, log_path])  # no temporary export folder left


def test_terminated_is_143_in_process(tiny_dir, tmp_path, monkeypatch):
    """`Terminated` (SIGTERM under sigterm_as_interrupt) is told apart from Ctrl-C."""
    import megatron_ext.quantize.fp8 as fp8

    def terminated(*args, **kwargs):
        raise Terminated("received signal SIGTERM")

    monkeypatch.setattr(fp8, "quantize", terminated)
    (tmp_path / "c.txt").write_text(_words(200))
    code, err = _main(["--hf", str(tiny_dir), "--out", str(tmp_path / "o"), "--calib", str(tmp_path / "c.txt"),
                       "--calib-samples", "2", "--calib-seq-length", "32"])
    assert code == 143 and "error: interrupted (SIGTERM)" in err, err


def test_indexed_calibration_data_of_another_tokenizer_or_kind(tiny_dir, token_data, sft_data, toy_tokenizer,
                                                               tmp_path, monkeypatch):
    """--calib PREFIX read any indexed dataset as token ids: data of another tokenizer whose ids stay below the
    model's vocab_size, an SFT dataset, even its loss mask (0/1), calibrated the FP8 scales and were exported (exit
    0). The manifest's kind and vocabulary sha256 say so before the model loads."""
    import megatron_ext.quantize.fp8 as fp8

    load_model = fp8.load_model

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the calibration data was checked")

    monkeypatch.setattr(fp8, "load_model", no_load)
    run = ["--hf", tiny_dir, "--out", tmp_path / "o", "--calib-samples", 1, "--calib-seq-length", 64]
    line = _fails(*run, "--calib", token_data)  # tiny_dir's tokenizer is a WordLevel one, the data's a BPE
    assert line.startswith(f"error: --calib {token_data} was tokenized with another tokenizer ({toy_tokenizer}, "
                           "vocabulary sha256:"), line
    assert line.endswith(f"prepare it again with --tokenizer {tiny_dir} (tools/prepare_data.py cpt)"), line
    assert _fails(*run, "--calib", sft_data) == (f"error: --calib {sft_data} is an SFT dataset (manifest kind 'sft'); "
                                                 "give a CPT prefix (tools/prepare_data.py cpt)")
    assert _fails(*run, "--calib", sft_data + "_lossmask") == (
        f"error: --calib {sft_data}_lossmask is the loss mask of the SFT dataset {sft_data}, not tokens; give a CPT "
        "prefix (tools/prepare_data.py cpt)")
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(fp8, "load_model", load_model)  # the control: with the data's tokenizer it exports
    code, err = _main([str(a) for a in run] + ["--calib", token_data, "--tokenizer", toy_tokenizer])
    assert code == 0 and (tmp_path / "o" / "config.json").is_file(), err


def test_a_mistake_is_the_only_line(tiny_dir, tmp_path):
    """nvidia-modelopt imports Megatron-Core for its plugins, whose import warned six times that Transformer Engine
    and Apex are missing (12 lines before the error; nothing this tool runs uses them). Control: those filters off,
    the warnings are back."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's default filters
    proc = subprocess.run([sys.executable, str(ROOT / "tools/quantize.py"), "--hf", str(tiny_dir), "--out",
                           str(tmp_path / "o"), "--calib", str(tmp_path / "missing")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]  # the tool's code for a mistake in its arguments
    assert proc.stderr.startswith(f"error: calibration data {tmp_path / 'missing'} not found")
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("at, sig, how, code", [("torch", signal.SIGINT, "Ctrl-C", 130),
                                                ("torch", signal.SIGTERM, "SIGTERM", 143),
                                                ("modelopt", signal.SIGINT, "Ctrl-C", 130)])
def test_an_interrupt_while_torch_or_modelopt_is_imported_is_held_until_after(at, sig, how, code, tiny_dir, tmp_path,
                                                                             tmp_path_factory):
    """Ctrl-C (to the terminal's process group) or SIGTERM while torch or ModelOpt was imported raised inside the
    import: there it can abort (pybind11's 'terminate called'); in 60 runs of the audit's sweep on a loaded machine
    it once ended in a traceback (-2) and once was lost in the import machinery ('Exception ignored in ...
    _get_module_lock'), the run going on. Now it is held until the import is done, then ends the run in the one line,
    130 / 143. Control (old cli.py): raised inside the import (the line and status as now, by luck)."""
    calib = tmp_path / "c.txt"
    calib.write_text(_words(400))
    status, err, raised = signalled_at_import("quantize.py", at, ["--hf", tiny_dir, "--out", tmp_path / "o", "--calib",
                                                                  calib, "--device", "cpu"],
                                              sig, tmp_path_factory.mktemp("flags"))
    assert status == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1:] == [
        f"error: interrupted ({how}); nothing was written (--out {tmp_path / 'o'} is written only by a complete run): "
        "run it again"], err
    assert not raised, f"the interrupt was raised inside the import of {at}"
    assert sorted(tmp_path.iterdir()) == [calib]


def test_a_dangling_config_json_link_is_named(tmp_path):
    """A hub cache whose blobs were pruned: config.json a symlink to nothing was 'no config.json there', as for a
    folder without one. Now the link and its target, as tools/convert.py says. Control (old fp8.py): 'no config.json'."""
    from megatron_ext.quantize.fp8 import QuantizeError, read_hf_config

    blob = tmp_path / "blobs" / "4567cdef"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").symlink_to(blob)
    with pytest.raises(QuantizeError, match=f"^--hf {tmp_path / 'hf'}: config.json is a symlink to {blob}, which does "
                                            "not exist; download the model again$"):
        read_hf_config(tmp_path / "hf")
    blob.mkdir(parents=True)
    with pytest.raises(QuantizeError, match=f"symlink to {blob}, which is not a file"):
        read_hf_config(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(QuantizeError, match="no config.json there"):
        read_hf_config(tmp_path / "hf")
