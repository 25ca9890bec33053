"""Resuming a NIAH sweep (`run_niah(previous=...)`, `tools/niah.py --resume`): the cells an earlier run scored are
kept, only the others run, and the grid equals one uninterrupted run."""

import json

import pytest

from megatron_ext.evaluate import EvalError, run_niah
from megatron_ext.evaluate.niah import NiahResult
from tests.unit.test_evaluate import Recorder, _read_needle, make_tokenizer, save_tiny

LENGTHS, DEPTHS = [96, 200], [0, 50, 100]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def half_right(prompt: str) -> str:
    """Retrieves at some depths only, so that kept and new scores differ and both matter."""
    return _read_needle(prompt) if prompt.index("special magic number is") < len(prompt) // 2 else " 1."


def test_kept_cells_are_not_run_again_and_the_grid_is_the_uninterrupted_one(tok):
    whole = run_niah(None, tok, LENGTHS, DEPTHS, samples=2, generate=Recorder(tok, half_right), progress=False,
                     log=None)
    assert 0 < whole.accuracy < 1
    # a run stopped after the first length, saved as tools/niah.py saves it, read back
    partial = NiahResult.from_dict(json.loads(json.dumps(
        run_niah(None, tok, LENGTHS[:1], DEPTHS, samples=2, generate=Recorder(tok, half_right), progress=False,
                 log=None).to_dict())))
    again = Recorder(tok, half_right)
    resumed = run_niah(None, tok, LENGTHS, DEPTHS, samples=2, generate=again, previous=partial, progress=False,
                       log=None)
    assert sum(b.shape[0] for b in again.batches) == len(DEPTHS) * 2  # the second length only
    assert {b.shape[1] for b in again.batches} == {200}
    assert resumed.scores == whole.scores
    key = lambda c: (c["length"], c["depth"], c["sample"])  # noqa: E731
    assert sorted(map(key, resumed.cells)) == sorted(map(key, whole.cells))
    assert all(a["output"] == b["output"] for a, b in zip(sorted(resumed.cells, key=key), sorted(whole.cells, key=key)))
    # cells the earlier run could not score (out of memory) run again
    partial.cells[0].update(score=None, output=None, error="out of memory")
    third = Recorder(tok, half_right)
    run_niah(None, tok, LENGTHS, DEPTHS, samples=2, generate=third, previous=partial, progress=False, log=None)
    assert sum(b.shape[0] for b in third.batches) == len(DEPTHS) * 2 + 1


@pytest.mark.parametrize("change, key", [({"seed": 1}, "haystack"), ({"chat": True}, "chat"),
                                         ({"max_new_tokens": 8}, "max_new_tokens")])
def test_an_earlier_run_with_other_prompts_is_refused(change, key):
    """(Another seed changes the built-in filler first.)"""
    from tests.unit.test_evaluate import CHAT_TEMPLATE

    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    earlier = run_niah(None, tok, LENGTHS[:1], DEPTHS, generate=Recorder(tok, half_right), progress=False, log=None)
    with pytest.raises(EvalError, match=f"made with {key} = .*use another --out, or drop --resume"):
        run_niah(None, tok, LENGTHS, DEPTHS, generate=Recorder(tok, half_right), previous=earlier,
                 progress=False, log=None, **change)


def test_cli_resume(tmp_path, capsys):
    from megatron_ext.evaluate.cli import main

    model = save_tiny(tmp_path / "hf")
    common = ["--model", str(model), "--depths", "0,100", "--max-new-tokens", "4", "--no-progress"]
    main([*common, "--lengths", "96", "--out", str(tmp_path / "a")])
    main([*common, "--lengths", "96,200", "--out", str(tmp_path / "a"), "--resume"])
    assert "2 of 4 cells kept from the earlier run" in capsys.readouterr().out
    main([*common, "--lengths", "96,200", "--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert a["lengths"] == b["lengths"] == [96, 200] and a["scores"] == b["scores"]
    assert [c["output"] for c in a["cells"]] == [c["output"] for c in b["cells"]]
    with pytest.raises(SystemExit, match="holds results of .*hf, not .*other: use another --out"):
        main(["--model", str(tmp_path / "other"), "--lengths", "96", "--out", str(tmp_path / "a"), "--resume"])
    save_tiny(tmp_path / "hf")  # the same path saved again (another training run): its results are not these
    with pytest.raises(SystemExit, match=r"as it was then \(model.safetensors .*\), not as it is now"):
        main([*common, "--lengths", "96", "--out", str(tmp_path / "a"), "--resume"])


def test_an_edited_haystack_file_is_another_haystack(tmp_path):
    """Resume compared the haystack's path alone: an edited --haystack file kept the cells scored on the old text."""
    import itertools

    from megatron_ext.evaluate.haystack import filler_sentences

    tok = make_tokenizer()
    hay = tmp_path / "hay.txt"
    text = " ".join(itertools.islice(filler_sentences(3), 200))
    hay.write_text(text)
    earlier = run_niah(None, tok, LENGTHS[:1], DEPTHS, haystack=hay, generate=Recorder(tok, half_right),
                       progress=False, log=None)
    assert len(earlier.settings["haystack_sha256"]) == 64
    again = run_niah(None, tok, LENGTHS, DEPTHS, haystack=hay, generate=Recorder(tok, half_right), previous=earlier,
                     progress=False, log=None)  # control: the same text resumes
    assert again.settings["haystack_sha256"] == earlier.settings["haystack_sha256"]
    hay.write_text(text.replace("river", "garden"))
    with pytest.raises(EvalError, match="made with haystack_sha256 = .*use another --out, or drop --resume"):
        run_niah(None, tok, LENGTHS, DEPTHS, haystack=hay, generate=Recorder(tok, half_right), previous=earlier,
                 progress=False, log=None)


def test_cli_refuses_to_overwrite_earlier_results_without_resume(tmp_path):
    """An --out holding results.json (of another model, or of this one) was overwritten without a word; --resume
    alone noticed another model's. Now, without --resume, --force replaces them; RULER alike; ppl (no --resume)
    refuses another model's ppl.json only."""
    from megatron_ext.evaluate.cli import main

    one, two = save_tiny(tmp_path / "one"), save_tiny(tmp_path / "two")
    out = tmp_path / "a"
    common = ["--depths", "0,100", "--lengths", "96", "--max-new-tokens", "4", "--no-progress", "--out", str(out)]
    assert main(["--model", str(one), *common]) == 0
    before = (out / "results.json").read_bytes()
    for model in (two, one):  # another model's results, and a second run of the same model
        with pytest.raises(SystemExit) as e:
            main(["--model", str(model), *common])
        assert e.value.code == (f"error: --out {out} holds results of {one} (results.json; lengths 96; 2 cells); "
                                "pass --resume to extend them, --force to replace them, or another --out")
    assert (out / "results.json").read_bytes() == before
    assert main(["--model", str(one), *common, "--resume"]) == 0  # extends them (all kept)
    assert main(["--model", str(two), *common, "--force"]) == 0
    assert json.loads((out / "results.json").read_text())["settings"]["model"] == str(two)

    ruler = ["ruler", "--tasks", "vt", "--lengths", "200", "--samples", "1", "--max-new-tokens", "2", "--no-progress",
             "--out", str(tmp_path / "r")]
    assert main([*ruler, "--model", str(one)]) == 0
    with pytest.raises(SystemExit, match=r"holds results of .*one \(ruler\.json; lengths 200; 1 cell\); pass "
                                         "--resume to extend them, --force to replace them"):
        main([*ruler, "--model", str(two)])
    assert main([*ruler, "--model", str(two), "--force"]) == 0

    doc = tmp_path / "doc.txt"
    doc.write_text("The old river passes the garden near the hill. " * 20)
    ppl = ["ppl", "--text", str(doc), "--no-progress", "--out", str(tmp_path / "p")]
    assert main([*ppl, "--model", str(one)]) == 0
    assert main([*ppl, "--model", str(one)]) == 0  # the same model's curve, made anew
    with pytest.raises(SystemExit, match=r"holds results of .*one \(ppl\.json; 1 document\); pass --force to "
                                         "replace them, or another --out"):
        main([*ppl, "--model", str(two)])
    assert main([*ppl, "--model", str(two), "--force"]) == 0
    assert json.loads((tmp_path / "p/ppl.json").read_text())["settings"]["model"] == str(two)


def test_cli_resume_refuses_other_numerics(tmp_path, capsys):
    """--resume compared the prompts' settings alone: a bf16 run resumed in fp32 kept the bf16 cells, and
    results.json said float32 for all. Now another dtype, engine or tokenizer is one line naming it, old -> new, and
    the fix; the device is not compared (cpu and cuda at one dtype differ by kernels alone), nor are settings that
    older results did not record."""
    from megatron_ext.evaluate.cli import main

    model = save_tiny(tmp_path / "hf")
    out = tmp_path / "a"
    common = ["--model", str(model), "--depths", "0,100", "--max-new-tokens", "4", "--no-progress", "--out", str(out)]
    assert main([*common, "--lengths", "96", "--dtype", "bf16"]) == 0
    saved = json.loads((out / "results.json").read_text())
    assert (saved["settings"]["engine"], saved["settings"]["dtype"]) == ("hf", "bfloat16")
    assert len(saved["settings"]["tokenizer_sha256"]) == 64
    before = (out / "results.json").read_bytes()
    with pytest.raises(SystemExit) as e:
        main([*common, "--lengths", "96,200", "--dtype", "fp32", "--resume"])
    assert e.value.code == ("error: --resume: the earlier cells ran with dtype bf16, this run with fp32 (bf16 -> fp32): "
                            "resume with --dtype bf16, or use another --out")
    assert (out / "results.json").read_bytes() == before

    def edit(**settings):
        d = json.loads(before)
        d["settings"].update(settings)
        d["settings"] = {k: v for k, v in d["settings"].items() if v is not None}
        (out / "results.json").write_text(json.dumps(d))

    edit(engine="megatron", dtype="bf16")  # the Megatron engine's names
    with pytest.raises(SystemExit, match=r"ran with engine megatron, this run with hf \(megatron -> hf\): resume "
                                         "with --engine megatron, or use another --out$"):
        main([*common, "--lengths", "96,200", "--dtype", "bf16", "--resume"])
    other = make_tokenizer()
    other.chat_template = "{{ messages[0]['content'] }}"  # the same vocabulary, another template: other prompts
    other.save_pretrained(tmp_path / "tok")
    edit()
    with pytest.raises(SystemExit, match=r"tokenized by another tokenizer, .*hf \(sha256 [0-9a-f]{12}\) -> .*tok "
                                         r"\(sha256 [0-9a-f]{12}\): resume with --tokenizer .*hf, or use another --out$"):
        main([*common, "--lengths", "96,200", "--dtype", "bf16", "--tokenizer", str(tmp_path / "tok"), "--resume"])
    edit(device="cuda:0")  # another device at the same dtype: kept
    capsys.readouterr()
    assert main([*common, "--lengths", "96,200", "--dtype", "bf16", "--resume"]) == 0
    assert "2 of 4 cells kept from the earlier run" in capsys.readouterr().out
    edit(engine=None, tokenizer_sha256=None, dtype="float32")  # an older results.json: no engine nor tokenizer
    assert main([*common, "--lengths", "96,200", "--dtype", "fp32", "--resume"]) == 0
    assert "2 of 4 cells kept from the earlier run" in capsys.readouterr().out


def test_results_of_the_older_prompt_form_are_not_extended(tok):
    """The needle's edges changed (prompt_version 2): a grid of the older prompts is refused, not extended."""
    earlier = run_niah(None, tok, LENGTHS[:1], DEPTHS, generate=Recorder(tok, half_right), progress=False, log=None)
    older = earlier.to_dict()
    del older["settings"]["prompt_version"]
    with pytest.raises(EvalError, match="made with prompt_version = None, this run has 2: use another --out"):
        run_niah(None, tok, LENGTHS, DEPTHS, generate=Recorder(tok, half_right), previous=NiahResult.from_dict(older),
                 progress=False, log=None)
