"""`megatron_ext.train_setup.check_setup`: mistakes in paths and data found before any process group or model exists.

Each case used to fail later, with a bare traceback (seen by hand with recipes/tiny/cpt.yaml): the vocabulary
mismatch as `IndexError: index out of range in self` in the first forward step, a file as checkpoint.dir as
FileExistsError / NotADirectoryError / FileNotFoundError after the model was built, a truncated .idx as Megatron's
`ValueError: buffer is smaller than requested size`, an iteration folder as init_from with a checkpoint error that
named neither the field nor a fix (iteration folders are accepted since).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.recipe import RecipeError, load_recipe
from megatron_ext.train_setup import check_setup

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/tiny/cpt.yaml"
TINY = ["parallel.context=1", "train.seq_length=256", "train.global_batch_size=2", "train.steps=2"]


def recipe(out, data, *overrides):
    return load_recipe(RECIPE, [*TINY, f"checkpoint.dir={out}", f"data.prefix={data}", *overrides], world_size=1)


def copy_data(prefix: str, folder: Path) -> str:
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(prefix + suffix, folder / ("cpt" + suffix))
    return str(folder / "cpt")


def test_valid_setup_passes_and_makes_no_folder(tmp_path, token_data):
    check_setup(recipe(tmp_path / "a" / "run", token_data))
    assert list(tmp_path.iterdir()) == []  # the writability probe is removed; the run makes its folder itself


@pytest.mark.parametrize("where, message", [
    ("file", r"checkpoint\.dir = '.*/file': is a file, not a folder; give a folder path"),
    ("file/sub/run", r"checkpoint\.dir = '.*/file/sub/run': lies under .*/file, which is a file, not a folder"),
])
def test_checkpoint_dir_not_a_folder(tmp_path, token_data, where, message):
    (tmp_path / "file").write_text("")
    with pytest.raises(RecipeError, match=message):
        check_setup(recipe(tmp_path / where, token_data))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc (no folders can be made there)")
def test_checkpoint_dir_unwritable(token_data):
    # /proc refuses new folders even to root, for whom permission bits do not count
    with pytest.raises(RecipeError, match=r"checkpoint\.dir = '/proc/x/run': cannot make folders in /proc \(.*\); "
                                          r"give a writable folder path"):
        check_setup(recipe("/proc/x/run", token_data))


def test_tensorboard_dir_checked_like_the_checkpoint_dir(tmp_path, token_data, monkeypatch):
    (tmp_path / "file").write_text("")
    check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.tensorboard_dir={tmp_path / 'tb'}"))
    with pytest.raises(RecipeError, match=r"checkpoint\.tensorboard_dir = '.*/file/tb': lies under .*/file, which is "
                                          r"a file, not a folder"):
        check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.tensorboard_dir={tmp_path / 'file/tb'}"))
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # how Python marks a package as not importable
    with pytest.raises(RecipeError, match=r"checkpoint\.tensorboard_dir = '.*/tb': the tensorboard package is not "
                                          r"installed; pip install tensorboard"):
        check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.tensorboard_dir={tmp_path / 'tb'}"))
    check_setup(recipe(tmp_path / "run", token_data))  # not asked for: not needed


def test_vocab_smaller_than_the_data_ids(tmp_path, token_data):
    with pytest.raises(RecipeError, match=r"data prefix .*cpt holds token ids up to 5\d\d \(tokenizer .*, 512 ids\), "
                                          r"but model\.vocab_size = 256 has rows for ids 0\.\.255 only; set "
                                          r"model\.vocab_size to the model's tokenizer size \(at least 5\d\d\)"):
        check_setup(recipe(tmp_path / "run", token_data, "model.vocab_size=256"))


def test_vocab_check_on_an_older_manifest_uses_the_tokenizer_size(tmp_path, token_data):
    """Manifests written before `max_token_id` existed hold the tokenizer's size only."""
    import json

    prefix = copy_data(token_data, tmp_path)
    manifest = json.loads(Path(prefix + ".json").read_text())
    del manifest["max_token_id"]
    Path(prefix + ".json").write_text(json.dumps(manifest))
    with pytest.raises(RecipeError, match=r"was tokenized with ids up to 511 .* model\.vocab_size = 511 "):
        check_setup(recipe(tmp_path / "run", prefix, "model.vocab_size=511"))
    check_setup(recipe(tmp_path / "run", prefix, "model.vocab_size=512"))


def test_sft_vocab_counts_the_pad_id(tmp_path, sft_data, toy_tokenizer):
    import json

    manifest = json.loads(Path(sft_data + ".json").read_text())
    assert manifest["max_token_id"] >= manifest["pad_id"]
    with pytest.raises(RecipeError, match=rf"holds token ids up to {manifest['max_token_id']} "):
        check_setup(recipe(tmp_path / "run", sft_data, "train.stage=sft", "train.global_batch_size=1",
                           f"model.vocab_size={manifest['max_token_id']}"))


@pytest.mark.parametrize("suffix, keep, message", [
    (".idx", 100, r"cpt\.idx is truncated or corrupt \(100 bytes, but its header's \d+ sequences and \d+ document "
                  r"indices take \d+\); prepare the data again"),
    (".idx", 20, r"cpt\.idx is truncated or corrupt \(20 bytes, shorter than the 34-byte header\)"),
    (".bin", 1000, r"cpt\.bin is truncated or corrupt \(1000 bytes, its index points up to byte \d+\)"),
    (".bin", 0, r"cpt\.bin is truncated or corrupt \(0 bytes\)"),
    (".json", 10, r"cpt\.json is truncated or corrupt"),
])
def test_truncated_dataset(tmp_path, token_data, suffix, keep, message):
    prefix = copy_data(token_data, tmp_path)
    path = Path(prefix + suffix)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(RecipeError, match=message):
        check_setup(recipe(tmp_path / "run", prefix))


def checkpoint_root(folder: Path, iterations: list[int]) -> Path:
    """The layout of a checkpoint root (what check_setup looks at): iter_* folders and the latest pointer."""
    for it in iterations:
        (folder / f"iter_{it:07d}").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text(f"{iterations[-1]}\n")
    return folder


def test_init_from_a_root_or_one_of_its_iteration_folders(tmp_path, token_data):
    root = checkpoint_root(tmp_path / "ckpt", [2, 4])
    check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.init_from={root}"))
    with pytest.raises(RecipeError, match=r"checkpoint\.init_from = '.*iter_0000002': an iteration folder without "
                                          r"megatron_ext\.json, so not one a finished save wrote"):
        check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.init_from={root}/iter_0000002"))
    (root / "iter_0000002/megatron_ext.json").write_text("{}")
    check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.init_from={root}/iter_0000002"))  # not the latest
    with pytest.raises(RecipeError) as e:  # the folder above the checkpoint: named
        check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.init_from={tmp_path}"))
    assert str(e.value) == (f"checkpoint.init_from = '{tmp_path}': no latest_checkpointed_iteration.txt there, so not "
                            f"a Megatron checkpoint folder (found iterations: none); {root} is a checkpoint: give "
                            f"checkpoint.init_from={root}")
    (root / "latest_checkpointed_iteration.txt").unlink()  # a copy without its pointer: its latest iteration folder
    with pytest.raises(RecipeError, match=rf"\(found iterations: \[2, 4\]\); give checkpoint\.init_from={root}/"
                                          "iter_0000004$"):
        check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.init_from={root}"))
    (tmp_path / "empty").mkdir()  # nothing there nor below: what a checkpoint folder is
    with pytest.raises(RecipeError, match=r"\(found iterations: none\); give the folder that holds iter_\* "):
        check_setup(recipe(tmp_path / "run", token_data, f"checkpoint.init_from={tmp_path / 'empty'}"))


def train_cli(*overrides, **environ):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **environ)
    return subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(RECIPE), *TINY, *overrides],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_cli_one_line_before_the_model_is_built(tmp_path, token_data):
    """The trainer's own entry point (one process): exit 1, one error line, no traceback, no folder made."""
    prefix = copy_data(token_data, tmp_path)
    Path(prefix + ".idx").write_bytes(Path(prefix + ".idx").read_bytes()[:100])
    for overrides, fragment in (([f"data.prefix={token_data}", "model.vocab_size=256"], "model.vocab_size = 256"),
                                ([f"data.prefix={prefix}"], "cpt.idx is truncated or corrupt")):
        proc = train_cli(f"checkpoint.dir={tmp_path / 'run'}", *overrides)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]
        assert not (tmp_path / "run").exists()


def test_a_busy_rendezvous_port_is_one_line(tmp_path, token_data):
    """A MASTER_PORT another process holds (a second run started with the first one's exported port) was a
    DistNetworkError traceback; now one line naming the port and the fix. Nothing is written."""
    import socket

    from megatron_ext.runtime import ProcessEnv
    from megatron_ext.runtime.distributed import port_in_use

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = train_cli(f"checkpoint.dir={tmp_path / 'run'}", f"data.prefix={token_data}", MASTER_PORT=str(port))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    said = port_in_use(ProcessEnv(0, 1, 0, "127.0.0.1", port, "single"))  # its words: tests/unit/test_runtime.py
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [f"error: {said}"], \
        proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_mistake_before_the_ranks_meet_is_said_once_per_node(tmp_path, token_data):
    """Under torchrun or srun every rank finds a recipe mistake alike: the first rank of each node says it (rank 2 of
    a 2-GPU-per-node job below), the others exit 1 without a word (else 256 copies of the line in a 256-GPU log)."""
    for rank, local_rank, said in ((1, 1, False), (2, 0, True)):
        proc = train_cli(f"checkpoint.dir={tmp_path}", "train.lerning_rate=1", RANK=str(rank), LOCAL_RANK=str(local_rank),
                         WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
        assert proc.returncode == 1, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == said and all(e.startswith("error: train.lerning_rate: unknown key") for e in errors), \
            proc.stderr
    if not torch.cuda.is_available():  # a device mistake may be one task's alone: every rank says its own
        proc = train_cli(f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "runtime.device=cuda", RANK="1",
                         LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        assert proc.returncode == 1 and [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
            "error: rank 1: runtime.device = 'cuda' but no CUDA device is visible; use runtime.device=cpu"], proc.stderr


def test_iteration_folders_without_the_latest_pointer_are_refused(tmp_path, token_data):
    """Before, the trainer started over from init_from (the pointer decides), dropped the run's metrics and overwrote
    its iterations."""
    run = tmp_path / "run"
    for it in (4, 8):
        (run / f"iter_{it:07d}").mkdir(parents=True)
    message = (f"checkpoint.dir = '{run}' holds iter_0000008 and 1 older but no latest_checkpointed_iteration.txt "
               rf"\(.*\): to resume from it, `echo 8 > {run}/latest_checkpointed_iteration.txt`; to start over, give "
               "a new checkpoint.dir")
    with pytest.raises(RecipeError, match=message):
        check_setup(recipe(run, token_data))
    (run / "latest_checkpointed_iteration.txt").write_text("8")
    check_setup(recipe(run, token_data))


def test_an_iteration_folder_as_checkpoint_dir_is_refused(tmp_path, token_data, capsys):
    """checkpoint.dir naming one iter_* folder: the trainer found no latest pointer in it, trained from random weights
    and saved iter_*/iter_* inside the other run (exit 0; launch --check said ok). Refused when its root has the
    pointer, or when the folder holds a save's metadata (a copy without the pointer); a new folder of that name is
    not one. Control: without the check, no error."""
    from megatron_ext.launch import main as launch

    root = checkpoint_root(tmp_path / "ckpt", [2, 4])
    message = (f"checkpoint.dir = '{root}/iter_0000004' is an iteration folder of the checkpoint {root}: to resume, "
               f"give checkpoint.dir={root}; to start a new run from this iteration, "
               f"checkpoint.init_from={root}/iter_0000004 and a new checkpoint.dir")
    with pytest.raises(RecipeError) as e:
        check_setup(recipe(root / "iter_0000004", token_data))
    assert str(e.value) == message
    assert launch(["--check", "--recipe", str(RECIPE), "--world-size", "1", *TINY, f"data.prefix={token_data}",
                   f"checkpoint.dir={root}/iter_0000004"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"
    copy = tmp_path / "copy" / "iter_0000004"  # no pointer above it: its metadata tells
    copy.mkdir(parents=True)
    check_setup(recipe(copy, token_data))
    (copy / "megatron_ext.json").write_text("{}")
    with pytest.raises(RecipeError, match=r"is an iteration folder of the checkpoint .*/copy: to resume, give"):
        check_setup(recipe(copy, token_data))
    check_setup(recipe(tmp_path / "new" / "iter_0000009", token_data))


def test_a_resume_does_not_need_init_from_any_more(tmp_path, token_data):
    """A requeued stage resumes from its own checkpoint.dir and never reads init_from: a converted model deleted
    meanwhile stopped it in the job's preflight ("recipe check failed"), not requeued."""
    run, gone = tmp_path / "run", f"checkpoint.init_from={tmp_path / 'converted'}"
    with pytest.raises(RecipeError, match=r"checkpoint\.init_from = '.*/converted': not a folder"):  # control
        check_setup(recipe(run, token_data, gone))
    (run / "iter_0000002").mkdir(parents=True)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    check_setup(recipe(run, token_data, gone))


@pytest.mark.parametrize("variables, fp8_attention, refused", [
    ({"NVTE_FLASH_ATTN": "0"}, False, "NVTE_FLASH_ATTN=0"),  # a common TE workaround: Megatron asserted at build
    ({"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1"}, False, None),  # what Megatron sets itself: fine
    ({"NVTE_FLASH_ATTN": "1"}, True, "NVTE_FLASH_ATTN=1"),
])
def test_attention_backend_variables_megatron_refuses(tmp_path, token_data, monkeypatch, variables, fp8_attention,
                                                      refused):
    from megatron_ext.train_setup import TE_BACKEND_VARIABLES

    for key in TE_BACKEND_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    r = recipe(tmp_path / "run", token_data)
    if fp8_attention:  # the rule needs FP8 on cuda with TE: only the environment check is asked here
        import dataclasses

        r = dataclasses.replace(r, runtime=dataclasses.replace(r.runtime, fp8_attention=True))
    if refused is None:
        check_setup(r)
        return
    with pytest.raises(RecipeError, match=rf"{refused} in the environment: Megatron-Core chooses Transformer Engine's "
                                          r"attention backend itself \(here (auto|fused).*\) and refuses other "
                                          r"values of NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN; unset them"):
        check_setup(r)


def test_a_run_that_reads_its_data_more_than_once_is_warned(tmp_path, token_data):
    """The docs said to prepare 1B tokens, one epoch; the 4M recipe reads 150 x 2 x 4M = 1.26B: GPTDataset went
    over a quarter of the data twice without a word."""
    from megatron_ext.resume import train_split_tokens
    from megatron_ext.train_setup import epochs_warning, setup_warnings

    held = train_split_tokens(recipe(tmp_path, token_data))
    fits = held // 256 // 2  # steps of 2 x 256 tokens that the train split holds
    assert epochs_warning(recipe(tmp_path, token_data, f"train.steps={fits - 1}")) is None
    warning = epochs_warning(recipe(tmp_path, token_data, f"train.steps={fits + 1}"))
    need = (fits + 1) * 512 + 1
    assert warning == (f"train.steps x train.global_batch_size x train.seq_length = {need - 1:,} tokens (+1), but the "
                       f"train split of data.prefix holds {held:,}: GPTDataset goes over it 2 times, {need - held:,} "
                       f"tokens ({100 * (need - held) / need:.1f}% of the run) a second time or more; prepare at least "
                       f"{need:,} tokens for the train split (tools/prepare_data.py cpt --max-tokens; more with a "
                       "validation split), or lower train.steps")
    assert setup_warnings(recipe(tmp_path, token_data, f"train.steps={fits + 1}")) == [warning]


def test_data_cache_dir_takes_the_index_caches(tmp_path, token_data):
    """GPTDataset's index caches went to cache/ beside the data, whatever the recipe: a read-only data share stopped
    the run with Megatron-Core's advice to set a path_to_cache no setting reached."""
    from megatron_ext.training_data import TrainBatches

    (tmp_path / "file").write_text("")
    with pytest.raises(RecipeError, match=r"data\.cache_dir = '.*/file/cache': lies under .*/file, which is a file"):
        check_setup(recipe(tmp_path / "run", token_data, f"data.cache_dir={tmp_path / 'file/cache'}"))
    r = recipe(tmp_path / "run", token_data, f"data.cache_dir={tmp_path / 'caches'}")
    check_setup(r)
    TrainBatches(r, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    assert any((tmp_path / "caches").rglob("*.npy"))


def test_a_hugging_face_model_folder_as_checkpoint_dir_is_refused(tmp_path, token_data):
    """The run wrote iter_* folders, the latest pointer and metrics.jsonl beside the model's weights."""
    hf = tmp_path / "Llama-3.1-8B-Instruct"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model-00001-of-00004.safetensors").write_bytes(b"")
    with pytest.raises(RecipeError, match=r"checkpoint\.dir = '.*Llama-3\.1-8B-Instruct' is a Hugging Face model "
                                          r"folder .* convert it \(tools/convert\.py to-megatron\) and give that as "
                                          r"checkpoint\.init_from"):
        check_setup(recipe(hf, token_data))
    (hf / "latest_checkpointed_iteration.txt").write_text("1")  # a run's folder that also holds an export: allowed
    check_setup(recipe(hf, token_data))


def test_sft_conversations_longer_than_the_sequence_are_warned(tmp_path, sft_data):
    """Read at a shorter train.seq_length than prepared, most conversations were left out with one Python warning
    among the libraries' (gone under PYTHONWARNINGS=ignore)."""
    from megatron_ext.data.dataset_files import read_index
    from megatron_ext.train_setup import setup_warnings, sft_length_warning

    lengths = read_index(sft_data + ".idx").sequence_lengths
    sft = ROOT / "recipes/tiny/sft.yaml"

    def at(seq):
        return load_recipe(sft, [f"checkpoint.dir={tmp_path}", f"data.prefix={sft_data}", f"train.seq_length={seq}",
                                 "checkpoint.init_from=null"], world_size=1)

    assert sft_length_warning(at(int(lengths.max()))) is None
    short = int(lengths.max()) - 1
    warning = sft_length_warning(at(short))
    longer = int((lengths > short).sum())
    assert warning.startswith(f"{longer:,} of {lengths.size:,} conversations") and "are left out" in warning
    assert f"longer than train.seq_length = {short:,}" in warning and warning in setup_warnings(at(short))


def test_data_of_another_tokenizer_than_model_tokenizer_is_refused(tmp_path, token_data, toy_tokenizer):
    """Data prepared with one tokenizer and model.tokenizer another: the run trained, its checkpoint recorded (and the
    export shipped) the other tokenizer. The manifest's vocabulary fingerprint is compared with model.tokenizer's."""
    from megatron_ext.data.toy import build_toy_tokenizer

    check_setup(recipe(tmp_path / "run", token_data, f"model.tokenizer={toy_tokenizer}"))  # the data's own
    other = build_toy_tokenizer(tmp_path / "tok300", vocab_size=300)
    with pytest.raises(RecipeError, match=rf"data\.prefix = '{token_data}' was tokenized with '{toy_tokenizer}', whose "
                                          rf"vocabulary is not that of model\.tokenizer = '{other}': set model\.tokenizer "
                                          r"to the data's tokenizer, or prepare the data again with this one"):
        check_setup(recipe(tmp_path / "run", token_data, f"model.tokenizer={other}"))


def test_selective_recompute_under_transformer_engine_is_warned(tmp_path, token_data):
    """Megatron's selective recompute is the core attention, which TE's fused kernel runs keeping next to nothing."""
    from megatron_ext.train_setup import selective_recompute_warning

    gpu = ["runtime.device=cuda", "train.recompute=selective"]
    assert "no memory saved" in selective_recompute_warning(recipe(tmp_path, token_data, *gpu))
    assert selective_recompute_warning(recipe(tmp_path, token_data, *gpu, "runtime.attention=sdpa")) is None
    assert selective_recompute_warning(recipe(tmp_path, token_data, "train.recompute=selective")) is None  # CPU


def test_partial_rotary_is_warned_before_the_run(tmp_path, token_data):
    """A model rotating part of each head trains, but tools/convert.py to-hf refuses it (no HF Llama matches)."""
    from megatron_ext.train_setup import setup_warnings

    warnings = setup_warnings(recipe(tmp_path, token_data, "rope.partial_rotary_factor=0.5"))
    assert any("rope.partial_rotary_factor = 0.5" in w and "to-hf will refuse" in w for w in warnings), warnings
    assert not any("partial_rotary" in w for w in setup_warnings(recipe(tmp_path, token_data)))


def test_an_unusable_metrics_log_is_refused_before_the_run(tmp_path, token_data):
    """checkpoint.dir's metrics.jsonl a folder ended the trainer's rank 0 in an IsADirectoryError traceback (and
    `launch --check` said ok), a file of other bytes in a UnicodeDecodeError one, a link into a folder that does not
    exist in an error after the first step. Now check_setup (every rank: a stat) refuses the folder and the link,
    `launch --check` (which reads the file) all three, and the trainer says the file's one line before its first
    step. Control (old code): check_setup and check passed all three; the trainer's tracebacks."""
    from megatron_ext.launch_check import check

    runs = {"folder": tmp_path / "folder", "bytes": tmp_path / "bytes", "link": tmp_path / "link",
            "link_ok": tmp_path / "link_ok"}
    for run in runs.values():
        run.mkdir()
    (runs["folder"] / "metrics.jsonl").mkdir()
    (runs["bytes"] / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n')
    (runs["link"] / "metrics.jsonl").symlink_to(tmp_path / "gone" / "metrics.jsonl")
    (tmp_path / "elsewhere").mkdir()
    (runs["link_ok"] / "metrics.jsonl").symlink_to(tmp_path / "elsewhere" / "metrics.jsonl")  # the first line makes it
    said = {"folder": "is a folder, not a file; move it aside or remove it",
            "bytes": "is not UTF-8 text (byte 0xff at offset 12), so not a log the trainer wrote; move it aside",
            "link": f"is a symbolic link to {tmp_path}/gone/metrics.jsonl, whose folder {tmp_path}/gone does not exist"}
    for name, run in runs.items():
        overrides = [*TINY, f"checkpoint.dir={run}", f"data.prefix={token_data}", "runtime.device=cpu"]
        if name in ("folder", "link"):
            with pytest.raises(RecipeError, match=f"^checkpoint.dir = '{run}': its metrics.jsonl "):
                check_setup(recipe(run, token_data))
        else:
            check_setup(recipe(run, token_data))  # a stat only: every rank runs it
        if name == "link_ok":
            check(str(RECIPE), overrides, 1)
            continue
        with pytest.raises(RecipeError) as refused:
            check(str(RECIPE), overrides, 1)
        assert str(refused.value).startswith(f"checkpoint.dir = '{run}': its metrics.jsonl {said[name]}")
    for name in ("folder", "bytes"):  # refused by check_setup, and by the trainer's metrics log after the model is built
        proc = train_cli(f"checkpoint.dir={runs[name]}", f"data.prefix={token_data}")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and "step 1/" not in proc.stdout, \
            proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: checkpoint.dir = '{runs[name]}': its metrics.jsonl {said[name]}"), proc.stderr[-3000:]
    assert (runs["bytes"] / "metrics.jsonl").read_bytes() == b'{"step": 1}\n\xff\xfe\n'
