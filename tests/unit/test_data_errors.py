"""Bad input to tools/prepare_data.py: one clear line, non-zero exit, nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.data import DataError, build_cpt_datasets, toy

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import prepare_data  # noqa: E402


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return toy.build_toy_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return toy.write_jsonl(tmp_path_factory.mktemp("c") / "c.jsonl", toy.synthetic_corpus(12, seed=1))


def _fail(argv: list[str]) -> str:
    """Run the CLI in-process; return its error line (asserting it is one line and an error)."""
    with pytest.raises(SystemExit) as e:
        prepare_data.main(argv)
    msg = e.value.code
    assert isinstance(msg, str) and msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def _left(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))


def test_bad_inputs_give_one_line(tmp_path, tok_dir, corpus):
    out = str(tmp_path / "out")
    base = ["cpt", "--tokenizer", str(tok_dir), "--output", out, "--quiet"]
    assert "file not found" in _fail(base + ["--input", str(tmp_path / "missing.jsonl")])
    msg = _fail(base + ["--input", str(corpus), "--text-field", "body"])
    assert "no field 'body'" in msg and "fields: id, source, text" in msg
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty corpus" in _fail(base + ["--input", str(empty)])
    (tmp_path / "notok").mkdir()
    assert "no tokenizer.json" in _fail(["cpt", "--input", str(corpus), "--tokenizer", str(tmp_path / "notok"),
                                         "--output", out])
    assert "no such folder" in _fail(["cpt", "--input", str(corpus), "--tokenizer", str(tmp_path / "a" / "b"),
                                      "--output", out])
    msg = _fail(base + ["--input", str(corpus), "--seq-length", "100000"])
    assert "tokens missing" in msg and "100001" in msg
    assert "--upsample" in _fail(base + ["--input", str(corpus), "--upsample", "lt4k"])
    assert _left(tmp_path) == []  # no partial .bin/.idx/.json after any failure


def test_existing_output_needs_force(tmp_path, tok_dir, corpus):
    out = str(tmp_path / "out")
    argv = ["cpt", "--input", str(corpus), "--tokenizer", str(tok_dir), "--output", out, "--quiet"]
    assert prepare_data.main(argv) == 0
    before = (tmp_path / "out.bin").read_bytes()
    assert "already exists" in _fail(argv)
    assert (tmp_path / "out.bin").read_bytes() == before
    assert prepare_data.main(argv + ["--force"]) == 0
    assert _left(tmp_path) == ["out.bin", "out.idx", "out.json"]


def test_non_utf8_lines_are_counted_and_skipped(tmp_path, tok_dir, corpus, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = corpus.read_bytes().splitlines(keepends=True)
    bad.write_bytes(b"".join(lines[:3]) + b'{"text": "caf\xe9 \xff"}\n' + b"".join(lines[3:]) + b"{not json\n")
    from megatron_ext.data import prepare_cpt

    man = prepare_cpt([str(bad)], str(tok_dir), str(tmp_path / "out"), progress=False)
    assert man["documents"] == 12
    assert man["skipped"] == {"non_utf8_lines": 1, "bad_json_lines": 1, "not_object_lines": 0, "empty_documents": 0}
    err = capsys.readouterr().err
    assert "non-utf8 line skipped" in err and "bad.jsonl:4" in err


def test_sft_bad_input(tmp_path, tok_dir):
    out = str(tmp_path / "out")
    path = toy.write_jsonl(tmp_path / "s.jsonl", [{"conversation": []}])
    base = ["sft", "--tokenizer", str(tok_dir), "--output", out, "--seq-length", "512", "--quiet"]
    assert "no field 'messages'" in _fail(base + ["--input", str(path)])
    only_user = toy.write_jsonl(tmp_path / "u.jsonl", toy.synthetic_chats(4, seed=0, no_assistant_every=1))
    msg = _fail(base + ["--input", str(only_user)])
    assert "no usable SFT samples" in msg and "'no_assistant_turn': 4" in msg
    assert "--chat-template" in _fail(base + ["--input", str(only_user), "--chat-template", "nope.jinja"])
    assert "--max-samples 0: must be a positive" in _fail(base + ["--input", str(only_user), "--max-samples", "0"])
    assert "no field 'answer'" in _fail(base + ["--input", str(only_user), "--answer-field", "answer"])
    assert _left(tmp_path) == []


def test_reader_errors(tmp_path, tok_dir, corpus):
    with pytest.raises(DataError, match="not found; run tools/prepare_data.py"):
        build_cpt_datasets(str(tmp_path / "nothing"), 64)
    from megatron_ext.data import prepare_cpt

    man = prepare_cpt([str(corpus)], str(tok_dir), str(tmp_path / "c"), progress=False)
    with pytest.raises(DataError, match=f"{man['tokens'] + 1000 + 1 - man['tokens']} tokens missing"):
        build_cpt_datasets(str(tmp_path / "c"), man["tokens"] + 1000)
    with pytest.raises(DataError, match="need a number of training samples"):
        build_cpt_datasets([str(tmp_path / "c")] * 2, 32, weights=[1, 1])
    other = toy.build_toy_tokenizer(tmp_path / "tok300", vocab_size=300)
    prepare_cpt([str(corpus)], str(other), str(tmp_path / "d"), progress=False)
    with pytest.raises(DataError, match="different tokenizer"):
        build_cpt_datasets([str(tmp_path / "c"), str(tmp_path / "d")], 32, weights=[1, 1], num_samples=(8, None, None))
    with pytest.raises(DataError, match="expected 'sft'"):
        from megatron_ext.data import SFTPackedDataset

        SFTPackedDataset(str(tmp_path / "c"), 64)


def test_cli_subprocess(tmp_path, tok_dir, corpus):
    """The real entry point: one worker thread gives the same bytes; errors are one line, exit 1."""
    from megatron_ext.data import prepare_cpt

    prepare_cpt([str(corpus)], str(tok_dir), str(tmp_path / "ref"), upsample="all=1.5", progress=False)
    cli = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), "cpt", "--tokenizer", str(tok_dir)]
    proc = subprocess.run(cli + ["--input", str(corpus), "--output", str(tmp_path / "w1"), "--workers", "1",
                                 "--upsample", "all=1.5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s, 1 threads" in proc.stderr and "Traceback" not in proc.stderr
    # stderr is a pipe, as in a Slurm log: the progress is plain lines, no '\r' redraws piled up on one line
    assert "\r" not in proc.stderr and f"cpt: loading tokenizer {tok_dir}\n" in proc.stderr, proc.stderr
    assert any(ln.startswith("cpt: ") and "tok/s]" in ln for ln in proc.stderr.splitlines()), proc.stderr
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    proc = subprocess.run(cli + ["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: --input {tmp_path / 'nope.jsonl'}: file not found"]


def test_truncated_files_name_the_file(tmp_path, token_data, sft_data):
    """Megatron-Core's IndexedDataset raised a bare `ValueError: buffer is smaller than requested size` on a cut
    .idx (and read a cut .bin only when a missing document came up, mid-training): the readers name the file."""
    import shutil

    for prefix, name, files in ((token_data, "c", (".bin", ".idx", ".json")),
                                (sft_data, "s", (".bin", ".idx", ".json", "_lossmask.bin", "_lossmask.idx"))):
        for suffix in files:
            shutil.copy(prefix + suffix, tmp_path / (name + suffix))
    for path, keep in (("c.idx", 100), ("s_lossmask.idx", 100), ("s.bin", 10)):
        (tmp_path / path).write_bytes((tmp_path / path).read_bytes()[:keep])
    with pytest.raises(DataError, match=r"data prefix .*/c: .*/c\.idx is truncated or corrupt \(100 bytes, but "
                                        r"its header's \d+ sequences .*\); prepare the data again"):
        build_cpt_datasets(str(tmp_path / "c"), 64)
    from megatron_ext.data import SFTPackedDataset

    with pytest.raises(DataError, match=r"/s\.bin is truncated or corrupt \(10 bytes, its index points up to byte"):
        SFTPackedDataset(str(tmp_path / "s"), 256)
    shutil.copy(sft_data + ".bin", tmp_path / "s.bin")
    with pytest.raises(DataError, match=r"/s_lossmask\.idx is truncated or corrupt"):
        SFTPackedDataset(str(tmp_path / "s"), 256)


def test_upsample_rules_that_would_change_nothing(tmp_path, tok_dir, corpus, capsys):
    """'lt4q=0.5' read as a rule for a source named lt4q, and 'web:all=2.0' without --source-field (sources are the
    input names then), wrote the corpus unchanged without a word."""
    out = str(tmp_path / "out")
    base = ["cpt", "--input", str(corpus), "--tokenizer", str(tok_dir), "--output", out, "--quiet"]
    msg = _fail(base + ["--upsample", "lt4q=0.5"])
    assert "bad rule 'lt4q=0.5'" in msg and "N a token count (4096, 4k, 1m)" in msg
    msg = _fail(base + ["--upsample", "lt4k=0.5,web:all=2.0"])
    assert ("no document has source 'web', so its rule changes nothing; the sources (the input names, as no "
            "--source-field is given) are: c; name one of them, or pass --source-field FIELD") in msg, msg
    # with --source-field the sources are known once every document is read
    msg = _fail(base + ["--source-field", "source", "--upsample", "web:all=2.0,wbe:gt8k=3"])
    assert "no document has source 'wbe', so its rule changes nothing; the sources (--source-field source) are: " \
           "book, code, web; fix the rule or --source-field" in msg, msg
    assert _left(tmp_path) == []
    # --max-tokens may stop before a source comes up: a warning, the data is written
    assert prepare_data.main(base + ["--source-field", "source", "--upsample", "wbe=2", "--max-tokens", "50"]) == 0
    err = capsys.readouterr().err
    assert "warning: --upsample wbe=2: no document has source 'wbe'" in err and "before --max-tokens 50" in err
    assert prepare_data.main(base + ["--force", "--upsample", "c:lt4k=0.5,lt10=2"]) == 0  # the input's own name


def test_max_tokens_help_says_documents_are_not_cut():
    """`--max-tokens 1000` wrote 1067 tokens where the help said 'stop after this many tokens'
    (test_data_cpt.test_max_tokens_and_manifest pins the behaviour)."""
    cpt = next(a for a in prepare_data._parser()._actions if a.dest == "cmd").choices["cpt"]
    help_ = next(a.help for a in cpt._actions if a.dest == "max_tokens")
    assert "stop after the document" in help_ and "never cut" in help_ and "exceed it" in help_


def test_sft_bad_chat_template_file(tmp_path, tok_dir):
    """An empty template file died with `ValueError: max() arg is an empty sequence`, a malformed one with a
    jinja2 TemplateSyntaxError traceback: one line naming --chat-template, the file and the Jinja error now."""
    chats = toy.write_jsonl(tmp_path / "chats.jsonl", toy.synthetic_chats(4, seed=0))
    base = ["sft", "--input", str(chats), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"),
            "--seq-length", "256", "--quiet", "--chat-template"]
    cases = [
        ("empty", "\n", "empty template; write a Jinja chat template into it (one that renders `messages`), or use "
                        "--chat-template llama3.1 or tokenizer"),
        ("broken", "{% for m in messages %}\n{{ m.content ",
         "Jinja syntax error at line 2: unexpected end of template, expected 'end of print statement'."),
        ("silent", "{# renders nothing #}", "the template renders a conversation as empty text; it must output the "
                                            "`messages` (use --chat-template llama3.1 for Llama-3.1's format)"),
        ("raising", "{{ raise_exception('roles must alternate') }}",
         f"rendering {chats}:1 failed (TemplateError: roles must alternate); fix the template or that sample"),
    ]
    for name, text, said in cases:
        template = tmp_path / f"{name}.jinja"
        template.write_text(text)
        assert _fail(base + [str(template)]) == f"error: --chat-template {template}: {said}"
    assert _left(tmp_path) == []


@pytest.mark.parametrize("kind", ["cpt", "sft"])
def test_output_must_be_a_prefix_not_a_folder(tmp_path, tok_dir, corpus, kind):
    """`--output O/` (or an existing folder O) exited 0 having written hidden files O/.bin, O/.idx, O/.json."""
    if kind == "cpt":
        argv = ["cpt", "--input", str(corpus)]
        files = "PREFIX.bin/.idx and PREFIX.json"
    else:
        argv = ["sft", "--input", str(toy.write_jsonl(tmp_path / "chats.jsonl", toy.synthetic_chats(4, seed=0))),
                "--seq-length", "256"]
        files = "PREFIX.bin/.idx, PREFIX_lossmask.bin/.idx and PREFIX.json"
    argv += ["--tokenizer", str(tok_dir), "--quiet", "--output"]
    (tmp_path / "out").mkdir()
    for output in (f"{tmp_path / 'out'}/", str(tmp_path / "out"), f"{tmp_path / 'out'}/."):
        assert _fail(argv + [output]) == (
            f"error: --output {output}: is a folder, but --output is a file prefix (it writes {files}); name the "
            f"files inside it, e.g. --output {tmp_path / 'out' / kind}")
    assert list((tmp_path / "out").iterdir()) == []
    assert _fail(argv + [""]) == f"error: --output '': empty; --output is a file prefix (it writes {files}), " \
                                 f"e.g. --output data/{kind}"
    assert _left(tmp_path) == ["out"]


def test_output_inside_a_file(tmp_path, tok_dir, corpus):
    """`--output afile/a`, afile a file: 'folder afile does not exist; create it first', which cannot be done."""
    argv = ["cpt", "--input", str(corpus), "--tokenizer", str(tok_dir), "--quiet", "--output"]
    afile = tmp_path / "afile"
    afile.write_text("")
    for output in (afile / "a", afile / "x" / "a"):
        assert _fail(argv + [str(output)]) == (f"error: --output {output}: {afile} is a file, not a folder; put the "
                                               "prefix in a folder (mkdir DIR, then --output DIR/a)")
    assert _fail(argv + [str(tmp_path / "none" / "a")]) == (f"error: --output {tmp_path / 'none' / 'a'}: folder "
                                                            f"{tmp_path / 'none'} does not exist; create it first")


def test_sft_samples_too_long_say_how_long(tmp_path, tok_dir):
    """`sft --seq-length 16` ended 'no usable SFT samples (... 'too_long': 4 ...)' without the fix; now it says the
    samples' lengths and to raise --seq-length, and the length it names keeps every one. Not said when another
    drop is the cause."""
    import re

    chats = toy.write_jsonl(tmp_path / "c.jsonl", toy.synthetic_chats(4, seed=0))
    base = ["sft", "--input", str(chats), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--quiet"]
    msg = _fail(base + ["--seq-length", "16"])
    found = re.search(r"'too_long': 4, .*\); 4 were too long \((\d+) to (\d+) tokens, beyond --seq-length 16\): raise "
                      r"--seq-length, to (\d+) to keep every one$", msg)
    assert found and 16 < int(found[1]) < int(found[2]) == int(found[3]), msg
    assert prepare_data.main(base + ["--seq-length", found[3]]) == 0
    from megatron_ext.data.dataset_files import read_manifest

    assert read_manifest(str(tmp_path / "out"))["samples"] == 4
    only_user = toy.write_jsonl(tmp_path / "u.jsonl", toy.synthetic_chats(4, seed=0, no_assistant_every=1))
    assert "too long" not in _fail(base[:2] + [str(only_user)] + base[3:] + ["--seq-length", "16", "--force"])


def test_cpt_bad_seq_length_and_workers(tmp_path, tok_dir, corpus):
    """cpt accepted --seq-length 0 / -1 (sft refuses them) and --workers -1 with exit 0."""
    base = ["cpt", "--input", str(corpus), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--quiet"]
    for n in ("0", "-1"):
        assert _fail(base + ["--seq-length", n]) == f"error: --seq-length {n}: must be positive"
    for kind in ("cpt", "sft"):
        argv = [kind, "--input", str(corpus), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"),
                "--seq-length", "64", "--workers", "-1"]
        assert _fail(argv) == "error: --workers -1: must be 0 (all cores) or a positive number of tokenizer threads"
    assert _left(tmp_path) == []


def test_cpt_text_field_of_the_wrong_type(tmp_path, tok_dir):
    """A number in the text field, or --text-field naming a dict, skipped every line as 'empty' and ended in
    'empty corpus (N empty)': the first such line is the error now. JSON null stays an empty document."""
    base = ["cpt", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--quiet"]
    nums = toy.write_jsonl(tmp_path / "nums.jsonl", [{"text": "fine text"}] + [{"text": 5}] * 20)
    assert _fail(base + ["--input", str(nums)]) == (
        f"error: {nums}:2: field 'text' is an int, not a string; give --text-field the name of the text field "
        "(fields: text)")
    rows = toy.write_jsonl(tmp_path / "rows.jsonl", [{"body": "hello world", "meta": {"source": "web", "lang": "en"}}])
    assert _fail(base + ["--input", str(rows), "--text-field", "meta"]) == (
        f"error: {rows}:1: field 'meta' is a dict (holding lang, source), not a string; give --text-field the name "
        "of the text field (fields: body, meta; a dotted name such as meta.lang reaches inside a dict)")
    lists = toy.write_jsonl(tmp_path / "lists.jsonl", [{"text": ["a", "b"]}])
    assert "field 'text' is a list, not a string" in _fail(base + ["--input", str(lists)])
    assert _left(tmp_path) == []
    nulls = toy.write_jsonl(tmp_path / "nulls.jsonl", [{"text": None}, {"text": "hello world"}])
    assert prepare_data.main(base + ["--input", str(nulls)]) == 0
    assert _left(tmp_path) == ["out.bin", "out.idx", "out.json"]


CHAT = '{"messages":[{"role":"user","content":"hi there"},{"role":"assistant","content":"hello"}]}'


@pytest.mark.parametrize("kind", ["cpt", "sft"])
def test_folder_input_reads_every_data_file(tmp_path, tok_dir, kind, capsys):
    """A folder --input was read by `datasets`, which takes a file with 'train' in its name for the train split and
    reads that one alone: a folder of corpus.jsonl + train_notes.jsonl gave train_notes' rows only, exit 0 (and a
    folder holding a run's cache/<md5>-GPTDataset-train-description.txt gave that JSON's lines as documents). Now
    every data file is read, in sorted order, as if given itself (a malformed line is skipped and counted, where
    `datasets` died mid-stream); the files that are not data are named in a warning, and the summary counts files."""
    import gzip

    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "cache").mkdir()
    (folder / ".git").mkdir()
    good = '{"text": "hello world"}' if kind == "cpt" else CHAT
    (folder / "corpus.jsonl").write_text(f"{good}\n{good}\n")
    (folder / "train_notes.jsonl").write_text(f"{good}\n{{\"messages\": [\n")  # the second line: not JSON
    with gzip.open(folder / "sub" / "more.jsonl.gz", "wt") as f:
        f.write(f"{good}\n")
    (tmp_path / "elsewhere").mkdir()  # shards linked in are read; a link back up is not walked again
    (tmp_path / "elsewhere" / "linked.jsonl").write_text(f"{good}\n")
    (tmp_path / "elsewhere" / "up").symlink_to(tmp_path)
    (folder / "link").symlink_to(tmp_path / "elsewhere")
    not_data = [folder / "README.md", folder / "cache" / f"{'0' * 32}-GPTDataset-train-description.txt",
                folder / "cache" / f"{'0' * 32}-GPTDataset-train-sample_index.npy", folder / "prep.json",
                folder / "prep.idx"]
    for path in not_data:
        path.write_text("{\n")
    (folder / ".hidden.jsonl").write_text("{\n")  # hidden files and folders are left out, as `datasets` did
    (folder / ".git" / "x.jsonl").write_text("{\n")
    argv = [kind, "--input", str(folder), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out")]
    argv += ["--seq-length", "256"] if kind == "sft" else []
    assert prepare_data.main(argv) == 0
    from megatron_ext.data.dataset_files import read_manifest

    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["documents"] == 5 and manifest["skipped"]["bad_json_lines"] == 1
    err = capsys.readouterr().err
    unread = sorted(map(str, not_data))
    assert (f"warning: --input {folder}: 5 files in it not read, as not data: {unread[0]}, {unread[1]}, {unread[2]} "
            "and 2 more\n") in err
    assert f"warning: {folder / 'train_notes.jsonl'}:2: bad-json line skipped" in err
    assert f": 5 {'documents' if kind == 'cpt' else 'samples'} from 4 files, " in err


def test_folder_input_of_mixed_types_or_no_data_is_refused(tmp_path, tok_dir, corpus):
    """A folder's data files must be of one type: a .json or .txt beside .jsonl shards is more likely a tokenizer's
    file or a README than data, and a .txt read as data makes each of its lines a document. Refused, naming each
    type's files; as is a folder with no data file, and a file that a folder given too reads already."""
    base = ["cpt", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--quiet", "--input"]
    folder = tmp_path / "mix"
    folder.mkdir()
    (folder / "corpus.jsonl").write_bytes(corpus.read_bytes())
    (folder / "train_notes.json").write_text('{"text": "x"}\n')
    assert _fail(base + [str(folder)]) == (
        f"error: --input {folder}: holds data files of more than one type (1 .json: {folder / 'train_notes.json'}; "
        f"1 .jsonl: {folder / 'corpus.jsonl'}); a folder is read as files of one type, as a mix is most often data "
        "beside files that are not (a README.txt, a tokenizer's .json): give the data files themselves (--input "
        "FILE...), or move the others out")
    (folder / "train_notes.json").unlink()
    (folder / "cache").mkdir()
    (folder / "cache" / "x.npy").write_bytes(b"")
    assert _fail(base + [str(folder / "cache")]) == (
        f"error: --input {folder / 'cache'}: no data files in this folder or its subfolders (types read: .jsonl, "
        f".json, .parquet, .txt, .jsonl.gz, .json.gz, .txt.gz); it holds {folder / 'cache' / 'x.npy'}; give a "
        "folder of data files, or the files themselves")
    assert _fail(base + [str(folder), str(folder / "corpus.jsonl")]) == (
        f"error: --input {folder / 'corpus.jsonl'}: is in the folder given as --input {folder}, which reads it too, "
        "so its data would be read twice; drop the repeat (cpt weights a source with --upsample SOURCE:all=RATE)")
    assert _fail(base + [str(folder / "corpus.jsonl"), str(folder)]) == (
        f"error: --input {folder}: holds {folder / 'corpus.jsonl'}, which --input {folder / 'corpus.jsonl'} reads "
        "too, so its data would be read twice; drop the repeat (cpt weights a source with --upsample "
        "SOURCE:all=RATE)")
    assert _left(tmp_path) == []


def test_json_input_that_is_not_json_lines(tmp_path, tok_dir):
    """A .json file holding a JSON array was read line by line: 'bad-json line skipped', then 'no usable SFT
    samples (... 1 bad JSON)'. Arrays and objects spread over lines are refused (reading them needs the whole file
    in memory; inputs are streamed): the error says the file is not JSON Lines and how to convert it."""
    import json

    chat = json.loads(CHAT)
    base = ["sft", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--seq-length", "256", "--quiet"]
    cases = [("one_line.json", json.dumps([chat, chat]), "is a JSON array", "'.[]'"),
             ("pretty.json", json.dumps([chat, chat], indent=2), "is a JSON array", "'.[]'"),
             ("object.jsonl", json.dumps(chat, indent=2), "holds a JSON object spread over several lines", ".")]
    for name, text, what, jq in cases:
        path = tmp_path / name
        path.write_text(text)
        assert _fail(base + ["--input", str(path)]) == (
            f"error: --input {path}: .json/.jsonl inputs must be JSON Lines (one object per line), but {path} {what}; "
            f"write one object per line (e.g. `jq -c {jq} {path} > OUT.jsonl`) and pass that file")
    assert _left(tmp_path) == []


def test_sft_lines_that_are_not_objects_and_the_end_report(tmp_path, tok_dir, capsys):
    """Valid JSON lines that hold no object ([1,2], "str") were called 'bad-json'; and sft promised that 'further
    ones are counted and reported at the end' but never printed that report (cpt did)."""
    path = tmp_path / "s.jsonl"
    path.write_text(f'[1, 2]\n{CHAT}\n"str"\n{{broken\n{CHAT}\n')
    argv = ["sft", "--input", str(path), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"),
            "--seq-length", "256", "--quiet"]
    assert prepare_data.main(argv) == 0
    err = capsys.readouterr().err
    assert (f"warning: {path}:1: not-an-object line skipped (a JSON array, not an object) (further ones are counted "
            "and reported at the end)") in err
    assert f"warning: {path}:4: bad-json line skipped" in err
    assert f"warning: skipped 2 not-an-object lines (first at {path}:1)" in err
    assert f"warning: skipped 1 bad-json lines (first at {path}:4)" in err
    from megatron_ext.data.dataset_files import read_manifest

    man = read_manifest(str(tmp_path / "out"))
    assert man["samples"] == 2
    assert man["skipped"] == {"non_utf8_lines": 0, "bad_json_lines": 1, "not_object_lines": 2}


def _prepare_sft_rows(tmp_path, tok_dir, rows, capsys):
    """`prepare_data.py sft` on `rows` written as JSON Lines, which must succeed: (input path, argv, stderr)."""
    import json

    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["sft", "--input", str(path), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"),
            "--seq-length", "256", "--quiet"]
    assert prepare_data.main(argv) == 0
    return path, argv, capsys.readouterr().err


def test_sft_unknown_roles_are_skipped_and_named(tmp_path, tok_dir, capsys):
    """A typo'd role ('usr') was rendered silently as a header the model never saw; with the built-in template such
    samples are dropped and counted (as bad_messages), the role named. Llama-3.1's own roles are all kept."""

    def chat(*roles):
        return {"messages": [{"role": r, "content": f"{r} says hi"} for r in roles]}

    rows = [chat("user", "assistant"), chat("usr", "assistant"), chat("wizard", "assistant"),
            chat("system", "user", "assistant", "tool", "ipython", "assistant"), chat("usr", "assistant")]
    path, argv, err = _prepare_sft_rows(tmp_path, tok_dir, rows, capsys)
    assert (f"warning: {path}:2: sample skipped: role 'usr' is not one of system, user, assistant, tool, ipython "
            "(further ones are counted and reported at the end)") in err
    assert ("warning: dropped 3 samples: {'no_assistant_turn': 0, 'too_long': 0, 'bad_messages': 3}; unknown roles: "
            "usr (2), wizard (1)") in err
    from megatron_ext.data.dataset_files import read_manifest

    assert read_manifest(str(tmp_path / "out"))["samples"] == 2
    # every sample with such a role dropped: the error names the roles
    only_bad = toy.write_jsonl(tmp_path / "bad.jsonl", [chat("usr", "assistant")])
    msg = _fail(argv[:2] + [str(only_bad)] + argv[3:] + ["--force"])
    assert "no usable SFT samples" in msg and "'bad_messages': 1}; unknown roles: usr (1);" in msg
    # a structural problem is named too
    assert prepare_data.main(argv[:2] + [str(toy.write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "user"}]}, chat("user", "assistant")]))] + argv[3:] + ["--force"]) == 0
    assert (f"{tmp_path / 'm.jsonl'}:1: sample skipped: message 1 of 'messages' is not an object with string 'role' "
            "and 'content'") in capsys.readouterr().err
    # a custom template decides what a role means: kept, with a warning
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
    assert prepare_data.main(argv + ["--force", "--chat-template", str(tpl)]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {path}:2: role 'usr' is not one of Llama-3.1's (system, user, assistant, tool, ipython); "
            f"kept, as --chat-template {tpl} renders it (a typo? fix the data)") in err
    assert "kept samples with roles Llama-3.1 does not know; unknown roles: usr (2), wizard (1)" in err
    assert read_manifest(str(tmp_path / "out"))["samples"] == 5


def test_an_input_given_twice(tmp_path, tok_dir, corpus, monkeypatch):
    """The same --input twice was read twice (its documents doubled) without a word."""
    base = ["--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--quiet"]
    assert _fail(["cpt", "--input", str(corpus), str(corpus)] + base) == (
        f"error: --input {corpus}: given twice, so its data would be read twice; drop the repeat (cpt weights a "
        "source with --upsample SOURCE:all=RATE)")
    monkeypatch.chdir(corpus.parent)
    msg = _fail(["sft", "--input", corpus.name, f"./{corpus.name}", "--seq-length", "64"] + base)
    assert msg.startswith(f"error: --input ./{corpus.name}: given twice (also as {corpus.name}), so its data"), msg
    assert _left(tmp_path) == []


def test_data_prefix_given_with_its_bin_ending(tmp_path, token_data, sft_data):
    """`data.prefix=.../cpt.bin` said '.../cpt.bin.bin not found; run tools/prepare_data.py first'; the hint is
    the prefix without the ending now (the trainer's setup check and the dataset readers alike)."""
    from megatron_ext.data import SFTPackedDataset
    from megatron_ext.recipe import RecipeError, load_recipe
    from megatron_ext.train_setup import check_setup

    hint = "not found; a data prefix names the dataset without its .bin/.idx/.json ending: give "
    with pytest.raises(DataError, match=f"data prefix {token_data}.bin: {token_data}.bin.bin {hint}{token_data}$"):
        build_cpt_datasets(token_data + ".bin", 64)
    with pytest.raises(DataError, match=f"{sft_data}.idx.bin {hint}{sft_data}$"):
        SFTPackedDataset(sft_data + ".idx", 256)
    recipe = load_recipe(ROOT / "recipes/tiny/cpt.yaml", ["parallel.context=1", "train.seq_length=256",
                                                         "train.global_batch_size=2", f"checkpoint.dir={tmp_path}/r",
                                                         f"data.prefix={token_data}.bin"], world_size=1)
    said = f"data.prefix = '{token_data}.bin': {token_data}.bin.bin {hint}{token_data}$"
    with pytest.raises(RecipeError, match=said):
        check_setup(recipe)


def test_sft_conversations_that_would_train_nothing_useful_are_skipped(tmp_path, tok_dir, capsys):
    """An assistant turn first crashed the whole preparation (transformers cannot render the empty conversation
    before it); an empty assistant turn, or tool calls the built-in template does not render, trained an empty
    reply. Each is skipped, counted and named; a good conversation beside them is kept."""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [{"messages": [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"},
                          {"role": "assistant", "content": "fine"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
            {"messages": [{"role": "user", "content": "time?"},
                          {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "clock"}}]}]},
            good]
    path, _, err = _prepare_sft_rows(tmp_path, tok_dir, rows, capsys)
    assert f"{path}:1: sample skipped: it starts with an assistant turn (no prompt before it)" in err
    assert "'bad_messages': 3}" in err
    from megatron_ext.data.dataset_files import read_manifest

    assert read_manifest(str(tmp_path / "out"))["samples"] == 1
    from megatron_ext.data.sft import _messages_problem

    assert _messages_problem(rows[1]["messages"], "messages", "llama3.1") == (
        "message 2 is an empty assistant turn (the model would learn to answer nothing)")
    assert _messages_problem(rows[2]["messages"], "messages", "llama3.1").startswith(
        "message 2 has tool_calls, which --chat-template llama3.1 does not render")
    assert _messages_problem(rows[2]["messages"], "messages", "tokenizer") is None  # Meta's template renders them
    assert _messages_problem(good["messages"], "messages", "llama3.1") is None
    surrogate = [{"role": "user", "content": "a \ud800"}, {"role": "assistant", "content": "b"}]  # valid JSON
    assert _messages_problem(surrogate, "messages", "llama3.1") == "message 1 holds a lone surrogate, no UTF-8 text"


def _tokenizer_without_llama3_tokens(out: Path) -> Path:
    """A byte-level BPE like the toy one, but with other special tokens (<s>, </s>): Llama-3's header and
    end-of-turn markers are not tokens of its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([d["text"] for d in toy.synthetic_corpus(30, seed=0)], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(out))
    return out


def test_sft_llama31_template_needs_llama3_tokens(tmp_path, tok_dir):
    """With the default --chat-template llama3.1 and a tokenizer lacking <|start_header_id|>, <|end_header_id|>
    and <|eot_id|>, sft wrote data in which each marker was ~10 text tokens and no end-of-turn token existed."""
    other = _tokenizer_without_llama3_tokens(tmp_path / "tok_plain")
    chats = toy.write_jsonl(tmp_path / "chats.jsonl", toy.synthetic_chats(4, seed=0))
    base = ["sft", "--input", str(chats), "--output", str(tmp_path / "out"), "--seq-length", "1024", "--quiet"]
    assert _fail(base + ["--tokenizer", str(other)]) == (
        f"error: --chat-template llama3.1: tokenizer {other} has no <|start_header_id|> / <|end_header_id|> / "
        "<|eot_id|> tokens (the template's markers would be split into ordinary text tokens); use the Llama-3.1 "
        "tokenizer, or --chat-template tokenizer / FILE.jinja")
    assert _left(tmp_path) == []
    # the toy tokenizer has Llama-3's special tokens: accepted
    assert prepare_data.main(base + ["--tokenizer", str(tok_dir)]) == 0


def test_gzip_inputs_whose_name_and_bytes_disagree(tmp_path, tok_dir, corpus):
    """Plain text named .jsonl.gz died with a gzip.BadGzipFile traceback, a cut .jsonl.gz with an EOFError one, and
    gzip data named .jsonl was read as 'empty corpus ... N non-UTF-8' lines: one line naming the file and fix now."""
    import gzip

    base = ["--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--quiet"]
    chats = toy.write_jsonl(tmp_path / "in" / "chats.jsonl", toy.synthetic_chats(20, seed=0))
    for kind, source in ((["cpt"], corpus), (["sft", "--seq-length", "256"], chats)):
        plain = tmp_path / "x.jsonl.gz"
        plain.write_bytes(source.read_bytes())
        packed = gzip.compress(source.read_bytes())
        cut = tmp_path / "cut.jsonl.gz"
        cut.write_bytes(packed[: len(packed) // 2])
        named_plain = tmp_path / "g.jsonl"
        named_plain.write_bytes(packed)
        assert _fail(kind + base + ["--input", str(plain)]) == (
            f"error: --input {plain}: not gzip data (it starts with b'{{\"', not the gzip bytes 1f 8b); if it is "
            f"plain text, rename it to x.jsonl (or compress it: gzip -c {tmp_path / 'x.jsonl'} > {plain})")
        msg = _fail(kind + base + ["--input", str(cut)])
        assert msg.startswith(f"error: --input {cut}: gzip data cut short or corrupt after line ") and msg.endswith(
            "(EOFError: Compressed file ended before the end-of-stream marker was reached); copy or download the "
            f"file again (`gzip -t {cut}` tells whether it is whole)"), msg
        assert _fail(kind + base + ["--input", str(named_plain)]) == (
            f"error: --input {named_plain}: is gzip-compressed (it starts with the gzip bytes 1f 8b), but its name "
            "says plain text; rename it to g.jsonl.gz (or decompress it: gunzip -c)")
    assert _left(tmp_path) == []
    good = tmp_path / "good.jsonl.gz"  # a whole one is read as before
    good.write_bytes(gzip.compress(corpus.read_bytes()))
    assert prepare_data.main(["cpt"] + base + ["--input", str(good)]) == 0


def test_empty_separator_suggests_none(tmp_path, tok_dir, corpus):
    argv = ["cpt", "--input", str(corpus), "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--quiet"]
    assert _fail(argv + ["--separator", ""]) == (
        "error: --separator '': encodes to no tokens; for no separator between documents pass --separator none, "
        "else give text (default '<s>') or bos-eos")
    assert "'none'" in prepare_data._parser()._subparsers._group_actions[0].choices["cpt"].format_help()
    assert _left(tmp_path) == []


def test_sigterm_removes_the_temporary_files(tmp_path, tok_dir):
    """`kill` / `scancel` (SIGTERM) left OUT.bin.tmpPID behind (corpus-sized at scale); Ctrl-C's cleanup runs now,
    and the command ends with one `error:` line and exit 143."""
    import signal
    import time

    docs = list(toy.synthetic_corpus(300, seed=3))
    big = toy.write_jsonl(tmp_path / "big.jsonl", (dict(d, id=i) for i in range(12) for d in docs))  # ~7 MB
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "prepare_data.py"), "cpt", "--input", str(big),
                             "--tokenizer", str(tok_dir), "--output", str(out), "--workers", "1", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tmp = Path(f"{out}.bin.tmp{proc.pid}")
        deadline = time.time() + 120
        while not (tmp.exists() and tmp.stat().st_size > 0):  # tokens are being written
            assert proc.poll() is None, f"prepare_data ended before writing: {proc.communicate()}"
            assert time.time() < deadline, f"{tmp} was not written"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert err.splitlines() == [f"error: interrupted (SIGTERM); the unfinished output was removed (--output {out} "
                                "is written only by a complete run)"], err
    assert _left(tmp_path) == []


def test_toy_inputs_need_a_new_folder(tmp_path):
    """`prepare_data.py toy --out DIR` writes the README's offline inputs; an existing file or non-empty folder is one
    error line (a file was a NotADirectoryError traceback)."""
    assert prepare_data.main(["toy", "--out", str(tmp_path / "toy"), "--documents", "3", "--chats", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "toy").iterdir()) == ["chats.jsonl", "corpus.jsonl", "tokenizer"]
    assert "not empty" in _fail(["toy", "--out", str(tmp_path / "toy")])
    (tmp_path / "f").write_text("x")
    assert "not a folder" in _fail(["toy", "--out", str(tmp_path / "f")])


# prepare_data.py toy, sent SIG (real, to the process) as the chats are drawn once the tokenizer is saved (the
# tokenizer's training draws 40); in a process of its own: the old code let SIGTERM end the process it ran in
_TOY_SIGNALLED = """
import signal, sys
sys.path.insert(0, sys.argv.pop(1))
import prepare_data
from megatron_ext.data import toy

sig, drawn = getattr(signal, sys.argv.pop(1)), toy.synthetic_chats


def chats_signalled(n, *args, **kwargs):
    if n == 2:
        signal.raise_signal(sig)
    return drawn(n, *args, **kwargs)


toy.synthetic_chats = chats_signalled
sys.exit(prepare_data.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, how, code", [("SIGINT", "Ctrl-C", 130), ("SIGTERM", "SIGTERM", 143)])
def test_an_interrupted_toy_leaves_no_half_folder(tmp_path, capsys, sig, how, code):
    """A signal while the toy inputs were written (here once the tokenizer is saved, as the chats are drawn) ended in
    a traceback (Ctrl-C; SIGTERM silently) and left --out half written, which the rerun refused as 'not empty'. Now
    the inputs are written beside --out and renamed into place when complete: one line, 130 / 143, nothing left,
    and the rerun writes them. Control (old _write_toy): -2 with a traceback / -15, toy/tokenizer left."""
    import signal

    argv = ["toy", "--out", str(tmp_path / "toy"), "--documents", "3", "--chats", "2"]
    proc = subprocess.run([sys.executable, "-c", _TOY_SIGNALLED, str(ROOT / "tools"), sig, *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # CI's background ignores it
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: interrupted ({how}); nothing was written (--out {tmp_path / 'toy'} is made only by a complete run)"]
    assert list(tmp_path.iterdir()) == []
    assert prepare_data.main(argv) == 0
    assert capsys.readouterr().err == (f"wrote {tmp_path / 'toy/tokenizer'}, {tmp_path / 'toy/corpus.jsonl'}, "
                                       f"{tmp_path / 'toy/chats.jsonl'}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy"]


def test_toy_into_an_existing_empty_folder(tmp_path, monkeypatch, capsys):
    """`--out .` in an empty folder, and --out an empty folder holding a killed run's staging folder: the inputs are
    written inside it (the folder stays: a shell there is not left in a deleted folder), nothing else is left.
    Control (the staging folder always beside --out): '.' has no name, the rename onto the working folder fails."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert prepare_data.main(["toy", "--out", ".", "--documents", "3", "--chats", "2"]) == 0
    assert sorted(p.name for p in here.iterdir()) == ["chats.jsonl", "corpus.jsonl", "tokenizer"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    (tmp_path / "again" / ".partial" / "tokenizer").mkdir(parents=True)  # a killed (SIGKILL) run's
    assert prepare_data.main(["toy", "--out", str(tmp_path / "again"), "--documents", "3", "--chats", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["chats.jsonl", "corpus.jsonl", "tokenizer"]
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"wrote {tmp_path / 'again/tokenizer'}, ")


def test_toy_onto_a_full_disk_is_one_line(small_disk):
    """The toy inputs (~0.5 MB) onto a 64 kB tmpfs: the corpus's write fails (ENOSPC). It was an OSError traceback
    that left the tokenizer in --out; now one line naming --out, and nothing left there."""
    said = _fail(["toy", "--out", str(small_disk / "toy")])
    assert re.fullmatch(re.escape(f"error: --out {small_disk / 'toy'}: no space left on device (") + r"0\.\d MB free "
                        r"there\); the unfinished output was removed; free space or choose another --out", said), said
    assert list(small_disk.iterdir()) == []


def test_output_without_room_is_one_line(tmp_path, tok_dir, corpus):
    """A write that runs out of room (a file-size limit here, EFBIG, no root needed; a full disk, ENOSPC, or a quota
    alike) ended in a 14-line traceback; now one line naming --output, with nothing left behind. Control (old code):
    the traceback ending `OSError: [Errno 27] File too large`."""
    import resource

    def small_files() -> None:  # the tokens (~10 kB) cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"), "cpt", "--input", str(corpus),
                           "--tokenizer", str(tok_dir), "--output", str(out), "--quiet"], capture_output=True,
                          text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: --output {out}: file too large (the file system's or the process's file-size limit, ulimit -f); the "
        f"unfinished output was removed (--output {out} is written only by a complete run); lift the file-size limit "
        "(ulimit -f) or use a file system that takes larger files"], proc.stderr
    assert _left(tmp_path) == []


@pytest.mark.parametrize("kind", ["cpt", "sft"])
def test_output_that_is_an_input_is_refused_even_with_force(tmp_path, tok_dir, kind):
    """`--input corpus.json --output corpus --force` replaced the corpus with the dataset's manifest (exit 0), and
    without --force the error asked for --force. Now one line naming both flags, with or without --force, for the
    file itself, a file of an input folder and an input that links to it; the input is untouched. Control (old
    code): exit 0 with --force (corpus.json became the manifest); without it "already exists; pass --force"."""
    rows = list(toy.synthetic_corpus(12, seed=1) if kind == "cpt" else toy.synthetic_chats(6, seed=1))
    data = toy.write_jsonl(tmp_path / "data.json", rows)
    before = data.read_bytes()
    (tmp_path / "folder").mkdir()
    inner = toy.write_jsonl(tmp_path / "folder" / "data.json", rows)
    (tmp_path / "link.jsonl").symlink_to(data)
    extra = ["--seq-length", "256"] if kind == "sft" else []
    cli = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), kind, "--tokenizer", str(tok_dir), *extra]
    prefix = str(tmp_path / "data")
    for force in ([], ["--force"]):
        proc = subprocess.run(cli + ["--input", str(data), "--output", prefix, *force], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 1 and proc.stderr.splitlines() == [
            f"error: --output {prefix}: would overwrite {data}, which --input {data} reads; give another --output "
            f"prefix, e.g. --output {prefix}_{kind}"], proc.stderr
    argv = [kind, "--tokenizer", str(tok_dir), *extra, "--force", "--quiet"]
    msg = _fail(argv + ["--input", str(tmp_path / "folder"), "--output", str(tmp_path / "folder" / "data")])
    assert f"would overwrite {inner}, which --input {tmp_path / 'folder'} (which holds {inner}) reads" in msg, msg
    msg = _fail(argv + ["--input", str(tmp_path / "link.jsonl"), "--output", prefix])
    assert f"which --input {tmp_path / 'link.jsonl'} (a link to it) reads" in msg, msg
    assert data.read_bytes() == before and inner.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json", "folder", "link.jsonl"]
