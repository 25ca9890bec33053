"""tools/niah.py: mistakes found before a model is loaded (numbers, --out, --device, files that are not UTF-8),
the tokenizer of a --megatron checkpoint saved without one, and the temporary HF copy of such a checkpoint
removed when the run is stopped with SIGTERM (scancel)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.evaluate import EvalError, file_haystack, perplexity_by_position, run_niah
from megatron_ext.evaluate.cli import main
from megatron_ext.presets import TINY
from tests.unit.test_evaluate import make_model, make_tokenizer, one_thread, tiny_dir  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
BINARY = bytes(range(256)) * 4  # 0x80 at byte 128 is the first byte UTF-8 cannot start a character with


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory, cpu_parallel_state) -> Path:
    """hf/: the tiny model saved without a tokenizer; mc/: its Megatron checkpoint (which records none);
    tok/: the model's tokenizer; big_tok/: a tokenizer with more ids than the model has embeddings."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.convert import to_megatron

    d = tmp_path_factory.mktemp("no_tokenizer")
    make_model().save_pretrained(d / "hf")
    to_megatron(d / "hf", d / "mc", progress=False)
    make_tokenizer().save_pretrained(d / "tok")
    words = {f"w{i}": i for i in range(TINY["vocab_size"] + 10)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")),
                            unk_token="w0").save_pretrained(d / "big_tok")
    return d


def _error(argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: "), e.value.code
    assert "\n" not in e.value.code  # one line
    return e.value.code


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),  # scored every cell 0 silently
    (["--samples", "-2"], "--samples -2: must be >= 1"),  # printed "batch -2 = -768.0 KiB" first
    (["--batch-tokens", "0"], "--batch-tokens 0: must be >= 1"),
    (["ruler", "--samples", "0"], "--samples 0: must be >= 1"),
    (["generate", "--question", "q", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["ppl", "--text", "{doc}", "--seq-len", "-5"], "--seq-len: '-5' is not a token count"),  # ran [:-5]
    (["ppl", "--text", "{doc}", "--seq-len", "0"], "--seq-len: '0' is not a positive whole number"),
    (["ppl", "--text", "{doc}", "--seq-len", "1"], "--seq-len 1: must be >= 2"),
    (["ppl", "--text", "{doc}", "--documents", "2"], "--documents 2 picks the longest documents of --indexed; "
                                                     "with --text every file is one document: drop --documents"),
    (["ppl", "--indexed", "data", "--documents", "0"], "--documents 0: must be >= 1"),
    (["ppl", "--text", "{doc}", "--per-octave", "0"], "--per-octave 0: must be >= 1"),
    (["--out", "{file}"], "--out {file} is a file: give a directory path"),
    (["--out", "{file}/sub"], "--out {file}/sub lies under {file}, which is a file"),
    (["--out", "a_file"], "--out a_file is a file: give a directory path"),  # relative: said "lies under a_file"
    (["generate", "--question", "q", "--out", "{file}/x"], "--out {file}/x lies under {file}, which is a file"),
    # a link to nowhere: mkdir's FileExistsError traceback at the first save, after a length had been evaluated
    (["--out", "{link}"], "--out {link} is a link to {tmp}/gone, which does not exist: create that folder, or "
                          "give another --out"),
    (["ruler", "--out", "{link}"], "--out {link} is a link to {tmp}/gone, which does not exist"),
    (["ppl", "--text", "{doc}", "--out", "{link}/sub"], "--out {link}/sub lies under {link}, which is a link to "
                                                        "{tmp}/gone, which does not exist"),
    (["generate", "--question", "q", "--out", "{link}"], "--out {link} is a link to {tmp}/gone, which does not"),
    (["--device", "tpu"], "--device tpu: not a device this tool runs on; give cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "--device cuda:99: " + ("this process sees" if torch.cuda.is_available() else
                                                      "no CUDA device is visible to this process")),
    (["--engine", "megatron", "--megatron", "{doc}", "--device", "cuda:0"],
     "--device cuda:0: " + ("the Megatron engine places each rank on its local GPU" if torch.cuda.is_available()
                            else "no CUDA device is visible")),
    (["--haystack", "{binary}"], "--haystack {binary}: not UTF-8 text (invalid start byte at byte 128)"),
    (["ruler", "--haystack", "{binary}"], "--haystack {binary}: not UTF-8 text"),
    (["ppl", "--text", "{binary}"], "--text {binary}: not UTF-8 text"),
    (["ppl", "--text", "{doc}", "{empty}"], "--text {empty}: no text in the file"),  # "got no document", no file named
    (["generate", "--document", "{binary}"], "--document {binary}: not UTF-8 text"),
    # an empty question ran (exit 0): the model went on after the document, or after nothing at all
    (["generate", "--document", "{doc}", "--question", ""], "--question '' is blank: give the question's text"),
    (["generate", "--question", " \n"], "--question ' \\n' is blank"),
])
def test_mistakes_are_one_line_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    files = {"doc": tmp_path / "doc.txt", "file": tmp_path / "a_file", "binary": tmp_path / "bin.txt",
             "empty": tmp_path / "empty.txt", "link": tmp_path / "link", "tmp": tmp_path}
    files["link"].symlink_to(tmp_path / "gone")
    files["doc"].write_text("The old river passes the garden near the hill. " * 10)
    files["empty"].write_text("\n")
    files["file"].write_text("not a directory")
    files["binary"].write_bytes(BINARY)
    argv = [a.format(**files) for a in argv]
    command = argv[:1] if argv[0] in ("ruler", "ppl", "generate") else []
    source = [] if "--megatron" in argv else ["--model", str(tiny_dir)]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "o")]
    msg = _error(command + source + out + ["--no-progress"] + argv[len(command):])
    assert message.format(**files) in msg
    assert "memory note" not in capsys.readouterr().out  # found before the model loaded
    assert not (tmp_path / "o").exists()


def test_dtype_is_one_of_the_loaders(capsys):
    from megatron_ext.evaluate.cli_args import DTYPE_NAMES
    from megatron_ext.evaluate.loading import _DTYPES

    assert sorted(DTYPE_NAMES) == sorted(_DTYPES)
    with pytest.raises(SystemExit):
        main(["--model", "m", "--out", "o", "--dtype", "abc"])
    assert "argument --dtype: invalid choice: 'abc'" in capsys.readouterr().err


def test_seq_len_takes_token_counts(tiny_dir, tmp_path, capsys):
    """--seq-len 1M as in README.md's example (an int only before); 100 cuts the document to 100 tokens. The memory
    note counts the tokens that run, not --seq-len (1M sized it for 1,048,576 tokens on a book of 3,236)."""
    from megatron_ext.evaluate.cli_args import parsers, validate_args

    args = parsers()["ppl"].parse_args(["--model", "m", "--text", "t", "--out", "o", "--seq-len", "1M"])
    validate_args("ppl", args)
    assert args.seq_len == 1 << 20
    doc = tmp_path / "doc.txt"
    doc.write_text("The old river passes the garden near the hill. " * 40)
    assert main(["ppl", "--model", str(tiny_dir), "--text", str(doc), "--seq-len", "100", "--out",
                 str(tmp_path / "ppl"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "ppl" / "ppl.json").read_text())["doc_tokens"] == [100]
    assert "; 100 tokens x batch 1 = " in capsys.readouterr().out
    doc.write_text("The old river passes the garden near the hill. " * 5)
    assert main(["ppl", "--model", str(tiny_dir), "--text", str(doc), "--seq-len", "1M", "--out",
                 str(tmp_path / "ppl"), "--no-progress"]) == 0
    n = json.loads((tmp_path / "ppl" / "ppl.json").read_text())["doc_tokens"][0]
    note = capsys.readouterr().out
    assert 2 < n < 100 and f"; {n:,} tokens x batch 1 = " in note and "1,048,576" not in note, note


def test_library_refuses_what_the_command_line_does(tmp_path):
    """run_niah, perplexity_by_position and file_haystack, called from a script, refuse the same inputs."""
    model, tok = make_model(), make_tokenizer()
    with pytest.raises(EvalError, match="max_new_tokens must be >= 1, got 0"):
        run_niah(model, tok, [64], [50], max_new_tokens=0, progress=False)
    for bad in (-5, 0, 1):
        with pytest.raises(EvalError, match=f"seq_len must be >= 2 tokens .* got {bad}"):
            perplexity_by_position(model, [torch.arange(3, 40)], seq_len=bad, progress=False)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(BINARY)
    with pytest.raises(EvalError, match="haystack file .* not UTF-8 text"):
        file_haystack(tok, binary, 64)
    with pytest.raises(EvalError, match="document file .* not UTF-8 text"):
        perplexity_by_position(model, tok, texts=[binary], progress=False)


def test_megatron_checkpoint_without_a_tokenizer(no_tokenizer, tmp_path):
    """--megatron on the hf engine: the error names the checkpoint and --tokenizer (it named a deleted temporary
    folder, and --tokenizer was refused); with --tokenizer it runs, and nothing temporary is left in --out."""
    mc, out = str(no_tokenizer / "mc"), tmp_path / "o"
    run = ["--megatron", mc, "--lengths", "64", "--depths", "50", "--max-new-tokens", "2", "--no-progress"]
    msg = _error(run + ["--out", str(out)])
    assert msg == (f"error: --megatron {mc}: the checkpoint records no tokenizer; give --tokenizer DIR_OR_NAME "
                   "(the tokenizer the model was trained with)")
    assert not out.exists()  # found before the conversion
    msg = _error(run + ["--out", str(out), "--tokenizer", str(no_tokenizer / "big_tok")])
    assert f"--tokenizer {no_tokenizer / 'big_tok'} has {TINY['vocab_size'] + 10} tokens but the model's " \
           f"vocab_size is {TINY['vocab_size']}" in msg
    assert f"cannot load its tokenizer (no local folder '{tmp_path / 'none'}', and as a hub name: " in \
        _error(run + ["--out", str(out), "--tokenizer", str(tmp_path / "none")])
    # a tokenizer_config.json value of the wrong type: transformers' AttributeError was a traceback
    (tmp_path / "bad_tok").mkdir()
    (tmp_path / "bad_tok" / "tokenizer_config.json").write_text('{"tokenizer_class": 5}')
    assert _error(run + ["--out", str(out), "--tokenizer", str(tmp_path / "bad_tok")]).startswith(
        f"error: --tokenizer {tmp_path / 'bad_tok'}: cannot load its tokenizer (AttributeError: ")
    assert main(run + ["--out", str(out), "--tokenizer", str(no_tokenizer / "tok")]) == 0
    assert json.loads((out / "results.json").read_text())["cells"]
    assert sorted(p.name for p in out.iterdir()) == ["heatmap.png", "results.json"]


def test_hf_directory_without_a_tokenizer(no_tokenizer, tmp_path):
    """A folder with no tokenizer files at all (tools/convert.py to-hf without --tokenizer) is said as such, by
    every command: transformers' error blamed a missing sentencepiece or tiktoken."""
    hf = no_tokenizer / "hf"
    want = (f"error: model directory {hf} has no tokenizer files (tokenizer.json, tokenizer_config.json); give "
            "--tokenizer DIR, or export again with tools/convert.py to-hf --tokenizer DIR")
    assert _error(["--model", str(hf), "--out", str(tmp_path / "o"), "--lengths", "64"]) == want
    assert _error(["ppl", "--model", str(hf), "--out", str(tmp_path / "o"), "--text", str(hf / "config.json")]) == want
    assert _error(["ruler", "--model", str(hf), "--out", str(tmp_path / "o"), "--lengths", "64"]) == want
    assert main(["--model", str(no_tokenizer / "hf"), "--tokenizer", str(no_tokenizer / "tok"), "--lengths", "64",
                 "--depths", "50", "--max-new-tokens", "2", "--out", str(tmp_path / "o"), "--no-progress"]) == 0


def test_sigterm_removes_the_converted_copy(no_tokenizer, tmp_path):
    """scancel (SIGTERM) during a --megatron run: the full-size HF copy in OUT/.hf-from-megatron.* is removed as
    on Ctrl-C (the default action of SIGTERM left it behind)."""
    out = tmp_path / "o"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools/niah.py"), "--megatron", str(no_tokenizer / "mc"),
                             "--tokenizer", str(no_tokenizer / "tok"), "--lengths", "256", "--depths", "0:100:1",
                             "--samples", "50", "--out", str(out), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        for line in proc.stdout:  # the memory note comes once the copy is loaded, before 5,050 prompts run
            if "memory note" in line:
                break
        assert len(list(out.glob(".hf-from-megatron.*"))) == 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert list(out.glob(".hf-from-megatron.*")) == []
    assert proc.returncode == 143 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: interrupted (SIGTERM)")


def test_sigterm_handlers_of_others_stay(tmp_path):
    """main installs its SIGTERM handler only over the default (submitit, which runs the launcher's evaluation
    stages in-process, installs its own) and puts the default back when it returns."""
    bad = ["--model", str(tmp_path), "--depths", "0,200", "--out", str(tmp_path / "o")]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    _error(bad)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def theirs(signum, frame):
        pass

    signal.signal(signal.SIGTERM, theirs)
    try:
        _error(bad)
        assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_generate_from_a_megatron_checkpoint_needs_out_for_the_conversion(no_tokenizer, tmp_path, capsys):
    """Without --out the conversion (a full copy of the weights, 16 GB at 8B) went to the system's temporary folder,
    e.g. a login node's small /tmp."""
    (tmp_path / "doc.txt").write_text("The old river passes the garden near the hill. " * 4)
    argv = ["generate", "--megatron", str(no_tokenizer / "mc"), "--tokenizer", str(no_tokenizer / "tok"),
            "--document", str(tmp_path / "doc.txt"), "--question", "q", "--no-progress", "--max-new-tokens", "2"]
    assert _error(argv).startswith(f"error: generate --megatron {no_tokenizer / 'mc'}: the transformers engine "
                                   "converts the checkpoint into a hidden folder of --out first; give --out DIR")
    assert "converting" not in capsys.readouterr().err
    main(argv + ["--out", str(tmp_path / "o")])  # control: with --out it answers, and leaves no copy behind
    assert "converting" in capsys.readouterr().err
    assert (tmp_path / "o/generation.json").exists() and not list((tmp_path / "o").glob(".hf-from-megatron*"))


def test_megatron_engine_stops_at_the_generation_configs_eos(no_tokenizer, tmp_path, cpu_parallel_state):
    """The Megatron engine took config.json's eos alone: a model naming <|eot_id|> only in generation_config.json
    (older Llama-3 Instruct snapshots) decoded past the end of its turn where the transformers engine stopped."""
    import shutil

    from megatron_ext.evaluate.engine import load_megatron_for_eval

    ckpt = tmp_path / "mc"
    shutil.copytree(no_tokenizer / "mc", ckpt)
    meta_file = next(ckpt.glob("iter_*/megatron_ext.json"))
    meta = json.loads(meta_file.read_text())
    eos = meta["hf_config"].get("eos_token_id")
    meta["generation_config"] = {"eos_token_id": [7, 9]}
    meta_file.write_text(json.dumps(meta))
    _, cfg, _ = load_megatron_for_eval(ckpt)
    assert cfg["eos_token_id"] == sorted({7, 9} | ({eos} if isinstance(eos, int) else set(eos or [])))
    meta["generation_config"] = None  # control: config.json's alone
    meta_file.write_text(json.dumps(meta))
    assert load_megatron_for_eval(ckpt)[1].get("eos_token_id") == eos


def test_depths_out_of_range_are_plain_numbers(tmp_path):
    """A START:END:STEP range beyond 100 printed numpy reprs: [np.float64(110.0), ...]."""
    msg = _error(["--model", "m", "--out", str(tmp_path / "o"), "--depths", "0:200:50"])
    assert msg == "error: --depths: [150.0, 200.0] are outside 0..100 (depth is the needle's position in percent " \
                  "of the haystack)"


def test_megatron_given_an_hf_folder_is_said_before_converting(tiny_dir, tmp_path, capsys):
    """tools/niah.py --megatron HF_DIR printed "[niah] converting ..." and created --out before its error."""
    msg = _error(["--megatron", str(tiny_dir), "--out", str(tmp_path / "o"), "--lengths", "64", "--no-progress"])
    assert msg == (f"error: --megatron {tiny_dir} is a Hugging Face model folder (config.json), not a Megatron "
                   f"checkpoint: pass --model {tiny_dir}")
    assert "converting" not in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_indexed_data_of_another_tokenizer_or_kind(tiny_dir, token_data, sft_data, toy_tokenizer, tmp_path, capsys):
    """ppl --indexed read any indexed dataset as token ids and exit 0: data of another tokenizer whose ids stay
    below the model's vocab_size, an SFT dataset (packed chats), even its loss mask (0/1 read as tokens). The
    manifest's kind and vocabulary sha256 say so, before the model loads (the trainer compares the same hash)."""
    run = ["ppl", "--model", str(tiny_dir), "--out", str(tmp_path / "o"), "--seq-len", "64", "--documents", "2",
           "--no-progress"]
    msg = _error(run + ["--indexed", token_data])  # tiny_dir's tokenizer is a WordLevel one, the data's a BPE
    assert msg.startswith(f"error: --indexed {token_data} was tokenized with another tokenizer ({toy_tokenizer}, "
                          "vocabulary sha256:"), msg
    assert msg.endswith(f"than the model's ({tiny_dir}, vocabulary sha256:{msg.split('sha256:')[2][:12]}); "
                        f"prepare it again with --tokenizer {tiny_dir} (tools/prepare_data.py cpt)"), msg
    assert _error(run + ["--indexed", sft_data]) == (f"error: --indexed {sft_data} is an SFT dataset (manifest kind "
                                                     "'sft'); give a CPT prefix (tools/prepare_data.py cpt)")
    assert _error(run + ["--indexed", sft_data + "_lossmask"]) == (
        f"error: --indexed {sft_data}_lossmask is the loss mask of the SFT dataset {sft_data}, not tokens; give a "
        "CPT prefix (tools/prepare_data.py cpt)")
    assert "memory note" not in capsys.readouterr().out  # all before the model loaded
    assert not (tmp_path / "o").exists()
    # the control: the model with the data's tokenizer (the tiny model has rows for its 512 ids) runs
    assert main(run + ["--indexed", token_data, "--tokenizer", toy_tokenizer]) == 0
    assert json.loads((tmp_path / "o" / "ppl.json").read_text())["documents"] == 2


def test_broken_megatron_checkpoint_gets_no_conversion_hint(no_tokenizer, tmp_path, capsys):
    """A checkpoint cut short, or a folder that is none, failed in the conversion with '...; convert it first with
    tools/convert.py to-hf ... and pass --model HF_DIR', which fails the same way. Now said before converting,
    without it; the hint stays where converting elsewhere helps: the copy into --out failed (RLIMIT_FSIZE: EFBIG)."""
    import resource
    import shutil

    ckpt = tmp_path / "runs" / "mc"
    shutil.copytree(no_tokenizer / "mc", ckpt)
    run = ["--tokenizer", str(no_tokenizer / "tok"), "--lengths", "64", "--depths", "50", "--max-new-tokens", "2",
           "--out", str(tmp_path / "o"), "--no-progress"]
    shard = next(ckpt.glob("iter_*/*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:1000])
    msg = _error(["--megatron", str(ckpt)] + run)
    assert msg.startswith(f"error: --megatron {ckpt}: {shard.parent}: incomplete checkpoint: {shard.name} has 1000 "
                          "bytes, the index needs "), msg
    msg = _error(["--megatron", str(ckpt.parent)] + run)
    assert msg.startswith(f"error: --megatron {ckpt.parent}: {ckpt.parent} has no latest_checkpointed_iteration.txt"
                          ": it is not a Megatron checkpoint root"), msg
    meta = next(ckpt.glob("iter_*/megatron_ext.json"))
    kept = meta.read_bytes()
    meta.unlink()
    meta.symlink_to("/proc/self/mem")  # a file whose reads fail (EIO), for root too: a traceback otherwise
    msg = _error(["--megatron", str(ckpt)] + run)
    assert msg == (f"error: --megatron {ckpt}: cannot read the checkpoint (Input/output error); check its files' "
                   "permissions, or copy it again"), msg
    assert "converting" not in capsys.readouterr().err and not (tmp_path / "o").exists()
    meta.unlink()
    meta.write_bytes(kept)
    shard.write_bytes(data)

    def small_files() -> None:  # the weights' copy (tens of kB) cannot be written, the results.json could
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools/niah.py"), "--megatron", str(ckpt)] + run,
                          capture_output=True, text=True, env=env, cwd=tmp_path, preexec_fn=small_files, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(f"error: converting {ckpt} to HF failed: "), last
    assert last.endswith(f"free space there, or convert it onto a file system with room (`python tools/convert.py "
                         f"to-hf --megatron {ckpt} --out HF_DIR`) and pass --model HF_DIR"), last


def test_out_may_not_be_the_model_folder(tiny_dir, tmp_path, monkeypatch, capsys):
    """`niah.py --model hf --out hf` ran (exit 0) and wrote results.json and heatmap.png among the model's weights;
    tools/convert.py refuses the same overlap. Now one line before the model loads, for --out the folder itself or
    inside it (a relative spelling, and through a link), for --model and --megatron, every subcommand. A folder
    holding the model is fine. Control (old code): the first case ran and exited 0."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dir, "hf")
    Path("alias").symlink_to(tmp_path / "hf")
    before = sorted(p.name for p in Path("hf").iterdir())
    (tmp_path / "doc.txt").write_text("The old river passes the garden near the hill. " * 10)
    run = ["--lengths", "256", "--depths", "50", "--max-new-tokens", "2", "--no-progress"]
    assert _error(["--model", "hf", "--out", "hf", *run]) == (
        "error: --out hf is --model hf (the model being evaluated): write the results to a separate folder, e.g. "
        "--out runs/niah")
    assert _error(["ppl", "--model", "./hf/", "--text", "doc.txt", "--out", "alias/ppl"]) == (
        "error: --out alias/ppl lies inside --model hf (the model being evaluated): write the results to a "
        "separate folder, e.g. --out runs/ppl")
    assert "lies inside --megatron hf" in _error(["ruler", "--megatron", "hf", "--out", "hf/r", "--lengths", "256"])
    assert "is --model" in _error(["generate", "--model", str(tmp_path / "hf"), "--question", "q", "--out", "hf"])
    assert sorted(p.name for p in Path("hf").iterdir()) == before
    assert "memory note" not in capsys.readouterr().out  # found before the model loaded
    assert main(["--model", "hf", "--out", ".", *run]) == 0 and Path("results.json").is_file()


def test_a_save_that_fails_is_one_line(tiny_dir, tmp_path):
    """A save after a length that fails (here a file-size limit, EFBIG, no root needed; a full disk or an --out
    changed under the run alike) ended in a traceback from write_atomic; now one line naming --out and the file,
    and no temporary file is left. Control (old code): the traceback ending `OSError: [Errno 27] File too large`."""
    import resource

    def small_files() -> None:  # the results (a few hundred bytes) cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "niah.py"), "--model", str(tiny_dir), "--lengths",
                           "64", "--depths", "50", "--max-new-tokens", "2", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"error: --out {out}: file too large") and f"cannot write {out / 'results.json'}" in last, \
        proc.stderr
    assert [p.name for p in out.iterdir()] == []


def test_a_mistake_on_another_rank_exits_1_without_a_line(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank finds a mistake alike: rank 0 says it, the others exit 1 silently (a rank that
    exits 0 is a success to torchrun and Slurm). Mutation audit round 3 (the others exited 0)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--samples", "0", "--no-progress"])
    assert e.value.code == 1
    assert capsys.readouterr().err == ""


def test_default_dtype_and_a_tokenizer_as_large_as_the_vocabulary():
    """resolve_dtype: bf16 on a GPU, fp32 on the CPU when --dtype is not given (--dtype's help); check_vocab: a
    tokenizer of exactly vocab_size ids (0 .. vocab_size-1, each with an embedding row) is the model's, one more
    id is not. Mutation audit round 3 (bf16 on the CPU; `>=` refused a tokenizer of the model's own size)."""
    from megatron_ext.evaluate.loading import check_vocab, resolve_dtype

    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cpu")) == torch.float16

    class Ids:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    check_vocab(Ids(512), 512, "t")
    check_vocab(Ids(7), None, "t")  # no vocab_size known: nothing to compare
    with pytest.raises(EvalError, match="t has 513 tokens but the model's vocab_size is 512"):
        check_vocab(Ids(513), 512, "t")


def test_atomic_outputs_get_the_permissions_of_a_plain_write(tmp_path):
    """write_atomic's file is made by mkstemp (0600): it is given what open() would have made under this umask
    (the oracle: a file written plainly beside it), so another user of the group can read the results. Mutation
    audit round 3 (the chmod dropped: 0600)."""
    from megatron_ext.evaluate.io import write_json_atomic, write_text_atomic

    old = os.umask(0o022)
    try:
        (tmp_path / "plain").write_text("x")
        for path in (write_json_atomic(tmp_path / "r.json", {"a": 1}), write_text_atomic(tmp_path / "r.md", "x")):
            assert path.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}


def test_the_early_tokenizer_is_the_one_the_run_uses(no_tokenizer):
    """early_tokenizer (ruler's length checks, then the run itself) is --tokenizer's when given, also with
    --model; data_tokenizer (ppl --indexed) raises a --megatron checkpoint's missing tokenizer for the hf engine,
    which needs one, and compares nothing for the Megatron engine, which reads ids alone. Mutation audit round 3
    (--tokenizer ignored with --model; the missing tokenizer raised for both engines)."""
    from argparse import Namespace

    from megatron_ext.evaluate.cli_model import data_tokenizer, early_tokenizer

    d = no_tokenizer
    given = early_tokenizer(Namespace(model=d / "hf", megatron=None, tokenizer=str(d / "big_tok")))
    assert len(given) == TINY["vocab_size"] + 10  # big_tok's, where hf/ holds no tokenizer at all
    args = Namespace(model=None, megatron=d / "mc", tokenizer=None, engine="hf")
    with pytest.raises(EvalError, match="the checkpoint records no tokenizer"):
        data_tokenizer(args)
    args.engine = "megatron"
    assert data_tokenizer(args) == (None, None)


def test_conversion_checks_tell_a_checkpoint_from_an_hf_folder_and_the_output_from_the_input(no_tokenizer, tmp_path):
    """check_convertible: a folder with config.json *and* iter_* folders is a Megatron checkpoint (a config.json
    kept beside it), not an HF folder; _about_the_output: a converter error naming the folder the copy goes into
    gets the free-space hint, one about the checkpoint does not. Mutation audit round 3 (the iter_* test dropped;
    the folder test dropped, leaving the errno texts alone)."""
    import shutil

    from megatron_ext.evaluate.loading import _about_the_output, check_convertible

    ckpt = tmp_path / "mc"
    shutil.copytree(no_tokenizer / "mc", ckpt)
    (ckpt / "config.json").write_text("{}")
    assert check_convertible(ckpt).name == "convert.py"
    out = tmp_path / "o" / ".hf-from-megatron.x" / "hf"
    assert _about_the_output(f"cannot write {out.parent}/.hf.staging/model.safetensors (Read-only file system)", out)
    assert _about_the_output("No space left on device", out)
    assert not _about_the_output(f"--megatron {ckpt}: iteration 7 is not in the checkpoint", out)


def test_a_conversion_that_fails_leaves_no_out_it_made(no_tokenizer, tmp_path):
    """A --megatron checkpoint that passes the checks before the conversion (files all there at their sizes) but
    cannot be read by the converter: one line, and the --out this run made for the conversion's hidden folder is
    removed again (left empty before). Mutation audit round 3 (the removal dropped: an empty --out stayed)."""
    import shutil

    ckpt = tmp_path / "mc"
    shutil.copytree(no_tokenizer / "mc", ckpt)
    for shard in (ckpt / "iter_0000000").glob("*.distcp"):  # same size, garbage content
        shard.write_bytes(b"\0" * shard.stat().st_size)
    out = tmp_path / "out"
    run = ["--megatron", str(ckpt), "--tokenizer", str(no_tokenizer / "tok"), "--out", str(out), "--device", "cpu",
           "--lengths", "64", "--no-progress"]
    msg = _error(run)
    assert msg.startswith(f"error: converting {ckpt} to HF failed: "), msg
    assert not out.exists()
    # an --out the user made (empty) is theirs: kept, with no hidden folder left in it (mutation audit round 9)
    out.mkdir()
    assert _error(run).startswith(f"error: converting {ckpt} to HF failed: ")
    assert out.is_dir() and not any(out.iterdir())
