"""Pins for megatron_ext/data/sources.py that the prepare_data tests left open (mutation audit round 6): the reader
functions called directly on small files, so each check takes milliseconds. The oracle is the module's docstrings
(what a folder input reads and in which order, what a hub name is, the one-line messages)."""

from __future__ import annotations

import json

import pytest

from megatron_ext.data.common import DataError
from megatron_ext.data.sources import ReadStats, check_inputs, folder_files, get_field, input_name, iter_texts


def test_get_field_through_a_non_dict_is_a_missing_field():
    """`--text-field meta.text` on a row whose 'meta' is a string that happens to contain 'text': a missing field
    (KeyError, which iter_texts turns into the one-line 'no field' DataError), not `"...text..."["text"]`'s
    TypeError traceback."""
    assert get_field({"meta": {"text": "x"}}, "meta.text") == "x"
    for row in ({"meta": "some text here"}, {"meta": ["text"]}, {"meta": None}):
        with pytest.raises(KeyError):
            get_field(row, "meta.text")


def test_a_dotted_text_field_through_a_string_is_one_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"meta": "some text here"}) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl:1: no field 'meta.text' \(fields: meta\); pass --text-field NAME"):
        list(iter_texts([str(path)], "meta.text", None, ReadStats()))


def test_summary_and_inputs_read_name_each_count_by_its_kind():
    """The counts in 'nothing usable' errors and the 'N documents from ...' line: each number under its own label."""
    stats = ReadStats(files=2, datasets=1, non_utf8=1, bad_json=2, not_object=3)
    assert stats.summary() == "1 non-UTF-8, 2 bad JSON, 3 not-an-object lines"
    assert stats.inputs_read() == "2 files and 1 Hugging Face dataset"
    assert ReadStats(files=1).inputs_read() == "1 file"
    assert ReadStats().inputs_read() == "no input"


def test_a_hub_name_with_a_split_is_labelled_by_its_name(tmp_path):
    """A hub input `owner/name:split` (no such local path) has the source label `owner/name`: the split is not part
    of the source (cpt's --upsample SOURCE rules name it without)."""
    assert input_name("someone/corpus:validation") == "someone/corpus"
    assert input_name("corpus") == "corpus"
    (tmp_path / "c.jsonl.gz").write_bytes(b"")
    assert input_name(str(tmp_path / "c.jsonl.gz")) == "c"


def test_an_empty_gz_input_is_an_empty_input(tmp_path):
    """An empty `.jsonl.gz` (a shard with no rows) is read as no rows, as gzip reads it: the name-and-bytes check
    looks at the first bytes only when there are any."""
    path = tmp_path / "empty.jsonl.gz"
    path.write_bytes(b"")
    check_inputs([str(path)])
    assert list(iter_texts([str(path)], "text", None, ReadStats())) == []


def test_a_hub_name_is_not_taken_for_a_missing_file(tmp_path, monkeypatch):
    """check_inputs opens nothing from the hub; `owner/name` and `owner/name:split` pass it, while a path of two
    folders or one ending in a data type that does not exist is 'file not found' before anything is opened."""
    monkeypatch.chdir(tmp_path)
    check_inputs(["someone/corpus", "someone/other:train", "plainname"])
    for missing in ("a/b/c", "gone.jsonl", "./x"):
        with pytest.raises(DataError, match=f"--input {missing}: file not found"):
            check_inputs([missing])


def test_folder_files_are_in_sorted_path_order_and_dunder_folders_are_left_out(tmp_path):
    """'read in sorted path order': a subfolder's file sorting before a top-level one comes first (os.walk lists the
    top folder's files before descending); folders named `__*` (__pycache__, as `datasets` leaves out) are not read."""
    (tmp_path / "a_sub").mkdir()
    (tmp_path / "__skipped").mkdir()
    for path in (tmp_path / "z.jsonl", tmp_path / "b.jsonl", tmp_path / "a_sub" / "x.jsonl",
                 tmp_path / "__skipped" / "y.jsonl"):
        path.write_text('{"text": "t"}\n')
    data, other = folder_files(tmp_path)
    assert data == [tmp_path / "a_sub" / "x.jsonl", tmp_path / "b.jsonl", tmp_path / "z.jsonl"]
    assert other == []


@pytest.mark.parametrize("others, said", [
    (["README.md"], "1 file in it not read, as not data: {0}README.md\n"),
    (["a.md", "b.md", "c.md"], "3 files in it not read, as not data: {0}a.md, {0}b.md, {0}c.md\n"),
    (["a.md", "b.md", "c.md", "d.md"], "4 files in it not read, as not data: {0}a.md, {0}b.md, {0}c.md and 1 more\n"),
])
def test_a_folders_files_that_are_not_data_are_warned_of(tmp_path, capsys, others, said):
    """Even one file left unread is named; three are listed whole (no ' and 0 more'), a fourth is counted."""
    (tmp_path / "c.jsonl").write_text('{"text": "t"}\n')
    for name in others:
        (tmp_path / name).write_text("notes\n")
    check_inputs([str(tmp_path)])
    err = capsys.readouterr().err
    assert err == f"warning: --input {tmp_path}: " + said.format(f"{tmp_path}/"), err


def test_gzip_cut_inside_its_header_says_before_its_first_line(tmp_path):
    """gzip data cut before a whole line came out: the error says where, 'before its first line' (not 'after line
    0'), and names the file."""
    import gzip

    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "hello"}\n' * 50)[:12])
    with pytest.raises(DataError, match=r"cut.jsonl.gz: gzip data cut short or corrupt before its first line \("):
        list(iter_texts([str(path)], "text", None, ReadStats()))


def test_blank_lines_in_json_lines_are_neither_rows_nor_bad_json(tmp_path, capsys):
    """A blank line (a trailing newline left twice, a spacer between shards cat-ed together) is no row and no
    malformed line: nothing is counted or warned of."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n\n')
    stats = ReadStats()
    assert [text for _, text in iter_texts([str(path)], "text", None, stats)] == ["a", "b"]
    assert (stats.bad_json, stats.non_utf8, stats.not_object, stats.empty) == (0, 0, 0, 0)
    assert capsys.readouterr().err == ""


def test_only_the_first_line_decides_that_a_file_is_not_json_lines(tmp_path, capsys):
    """A JSON Lines file with an array of objects, or a lone '{', on a later line has one bad line there: it is
    skipped and counted like any other (the 'not JSON Lines' refusal is for a file whose first line shows it)."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n[{"text": "b"}]\n{\n{"text": "c"}\n')
    stats = ReadStats()
    assert [text for _, text in iter_texts([str(path)], "text", None, stats)] == ["a", "c"]
    assert (stats.not_object, stats.bad_json) == (1, 1)
    assert f"warning: {path}:2: not-an-object line skipped (a JSON array, not an object)" in capsys.readouterr().err


def test_a_line_that_is_not_an_object_is_named_by_its_json_kind(tmp_path, capsys):
    """The first skipped line of each kind is warned of with what it holds: true is a JSON boolean, not a number."""
    for value, kind in (("true", "boolean"), ("null", "null"), ('"s"', "string"), ("1.5", "number")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(f'{{"text": "a"}}\n{value}\n')
        assert [t for _, t in iter_texts([str(path)], "text", None, ReadStats())] == ["a"]
        assert f"{path}:2: not-an-object line skipped (a JSON {kind}, not an object)" in capsys.readouterr().err


def test_a_malformed_first_line_is_a_bad_line_not_a_spread_object(tmp_path):
    """Only a lone '{' on the first line shows an object spread over lines; a first line cut short ('{"text": "a')
    is one bad-JSON line, skipped and counted, and the rest of the file is read."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "cut sho\n{"text": "b"}\n')
    stats = ReadStats()
    assert [t for _, t in iter_texts([str(path)], "text", None, stats)] == ["b"]
    assert stats.bad_json == 1


def test_empty_and_null_texts_are_counted_empty_not_documents(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": ""}\n{"text": null}\n{"text": "a"}\n')
    stats = ReadStats()
    assert [t for _, t in iter_texts([str(path)], "text", None, stats)] == ["a"]
    assert stats.empty == 2


def test_a_datasets_input_is_counted_as_one(tmp_path):
    """An input read through `datasets` counts as a Hugging Face dataset in the summary line. `FOLDER:train` is not a
    local path, so it takes the hub branch; `datasets` opens a local folder under that name (no network), as in
    test_data_cpt's stream test; rows are numbered from 1."""
    import logging

    from megatron_ext.data.sources import iter_rows

    # quieted while `datasets` reads (our error names the bad line itself), then given back its level
    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    json_log.setLevel(logging.INFO)
    folder = tmp_path / "hfds"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    stats = ReadStats()
    rows = list(iter_rows([f"{folder}:train"], stats))
    assert [(name, where, row["text"]) for name, where, row in rows] == [
        (str(folder), f"{folder}:train:row 1", "a"), (str(folder), f"{folder}:train:row 2", "b")]
    assert (stats.datasets, stats.files, stats.inputs_read()) == (1, 0, "1 Hugging Face dataset")
    assert json_log.level == logging.INFO


def test_a_text_field_holding_an_empty_dict_is_one_line(tmp_path):
    """A text field that is {} is the wrong field, said in one line like any dict (no dotted-name hint: there is no
    key to suggest), not an IndexError from suggesting its first key."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": {}, "body": "a"}\n')
    with pytest.raises(DataError) as e:
        list(iter_texts([str(path)], "text", None, ReadStats()))
    assert str(e.value) == (f"{path}:1: field 'text' is a dict, not a string; give --text-field the name of the text "
                            "field (fields: body, text)")
