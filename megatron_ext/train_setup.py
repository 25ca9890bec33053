"""Checks of a training recipe's paths and data before any process group exists or the model is built
(`python -m megatron_ext.train` and the launchers run them): mistakes end as one error line at once, not
minutes into a job."""

from __future__ import annotations

from pathlib import Path

from megatron_ext.recipe import Recipe, RecipeError


def check_setup(recipe: Recipe) -> None:
    """Static checks on paths and data before any process group exists or the model is built: the output folder
    can be made, the datasets are complete and fit the model's vocabulary, init_from is a checkpoint root or
    one of its iterations. Cheap: a few stat calls, a probe folder, each dataset's manifest and index, read with
    numpy alone (torch and Megatron-Core would cost `launch --check` ~8 s of CPU)."""
    import importlib.util
    import re

    from megatron_ext.checkpoint_index import METADATA_FILE

    if recipe.checkpoint.dir is None:
        raise RecipeError("checkpoint.dir: missing; set the output folder, e.g. checkpoint.dir=runs/cpt")
    _check_not_an_iteration_folder(recipe.checkpoint.dir)
    _check_folder_can_be_made("checkpoint.dir", recipe.checkpoint.dir)
    out = Path(recipe.checkpoint.dir)
    hf_weights = (out / "config.json").is_file() and (any(out.glob("*.safetensors"))
                                                      or any(out.glob("pytorch_model*.bin")))
    if hf_weights and not (out / "latest_checkpointed_iteration.txt").exists():
        # the run would write iter_* folders and metrics beside the model's weights
        raise RecipeError(f"checkpoint.dir = {recipe.checkpoint.dir!r} is a Hugging Face model folder (config.json and "
                          "weights): give a new folder for the run's checkpoints; to start from this model, convert it "
                          "(tools/convert.py to-megatron) and give that as checkpoint.init_from")
    check_metrics_file(recipe.checkpoint.dir, read=False)
    if recipe.checkpoint.tensorboard_dir is not None:
        _check_folder_can_be_made("checkpoint.tensorboard_dir", recipe.checkpoint.tensorboard_dir)
        if importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard's writer needs it
            raise RecipeError(f"checkpoint.tensorboard_dir = {recipe.checkpoint.tensorboard_dir!r}: the tensorboard "
                              "package is not installed; pip install tensorboard (or megatron-ext[tensorboard]), "
                              "or unset it")
    tok = recipe.model.tokenizer
    if tok is not None and (tok.startswith((".", "/", "~")) or tok.count("/") > 1) and not Path(tok).expanduser().is_dir():
        # a path, not a hub name: the checkpoint records it for the export and the evaluation, which would not find it
        raise RecipeError(f"model.tokenizer = {tok!r}: no such folder; give the model's tokenizer folder or hub name")
    largest = _largest_token_id(_tokenizer_json(tok))
    if largest is not None and largest >= recipe.model.vocab_size:
        # the checkpoint records it: the export ships it and evaluation fails on its first id beyond the embedding
        raise RecipeError(f"model.tokenizer = {tok!r} makes token ids up to {largest}, but model.vocab_size = "
                          f"{recipe.model.vocab_size} has rows for ids 0..{recipe.model.vocab_size - 1}: it is not this "
                          "model's tokenizer; give the one the model was trained with")
    check_data(recipe)
    if recipe.train.stage == "cpt" and recipe.data.prefixes:  # GPTDataset writes its index caches at the first start
        from megatron_ext.data.dataset_files import index_cache_folder

        cache = index_cache_folder(recipe.data.prefixes, recipe.data.cache_dir)
        if not Path(cache).is_dir():
            _check_folder_can_be_made("data.cache_dir" + ("" if recipe.data.cache_dir else " (null: cache/ beside "
                                      "data.prefix)"), cache)
    _check_attention_backend_variables(recipe)
    init = None if _resumes(recipe.checkpoint.dir) else recipe.checkpoint.init_from  # a resume never reads it
    if init is not None and not Path(init).is_dir():
        raise RecipeError(f"checkpoint.init_from = {init!r}: not a folder; give a Megatron checkpoint "
                          "(tools/convert.py to-megatron writes one)")
    if init is not None and (Path(init) / "latest_checkpointed_iteration.txt").is_file():
        from megatron_ext.checkpoint_index import CheckpointError
        from megatron_ext.checkpoint_layout import resolve_iteration_dir

        try:  # the pointer names a number and an iteration folder that exists
            resolve_iteration_dir(init)
        except CheckpointError as e:
            raise RecipeError(f"checkpoint.init_from = {init!r}: {e}") from None
    elif init is not None:
        folder = Path(init)  # not a root: one of its iterations, or not a checkpoint
        if not re.fullmatch(r"iter_\d+", folder.name):
            from megatron_ext.checkpoint_layout import not_a_root

            raise RecipeError(f"checkpoint.init_from = {init!r}: no latest_checkpointed_iteration.txt there, so not a "
                              f"Megatron checkpoint folder {not_a_root(folder, field='checkpoint.init_from')}")
        if not (folder / METADATA_FILE).is_file():
            raise RecipeError(f"checkpoint.init_from = {init!r}: an iteration folder without {METADATA_FILE}, so not "
                              "one a finished save wrote; give another iteration, or the checkpoint root (its latest)")
    if init is not None:
        from megatron_ext.checkpoint_index import CheckpointError
        from megatron_ext.checkpoint_layout import read_metadata
        from megatron_ext.resume import architecture_changes

        try:
            changed = architecture_changes(read_metadata(init).get("hf_config"), recipe)
        except CheckpointError:
            changed = []  # no run metadata: the load compares the tensors' shapes
        if changed:  # the load would blame tensor shapes, or (tie_word_embeddings) drop the output layer silently
            raise RecipeError(f"checkpoint.init_from = {init!r} holds another model ({'; '.join(changed)}): set the "
                              "recipe's model.* to the checkpoint's (or model.hf_config to its HF folder), or start "
                              "from another checkpoint")


METRICS_FILE = "metrics.jsonl"


def metrics_file_problem(path: Path, read: bool = True) -> str | None:
    """Why `path` cannot be the run's metrics log, as one line (the file, what is wrong, the fix); None where it can
    (absent included). The trainer rewrites it at every start and appends a line per step: a folder there ended rank 0
    in an IsADirectoryError traceback, a file of other bytes in a UnicodeDecodeError one, and a link into a folder that
    does not exist failed only after the first step. `read`: also read the whole file (rank 0 and `launch --check`;
    the stat alone on every rank)."""
    import os
    import stat

    where = f"checkpoint.dir = {str(path.parent)!r}: its {path.name}"
    aside = "move it aside or remove it (the trainer writes one JSON line per step to that file)"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            return None
        folder = Path(os.path.realpath(path)).parent
        if folder.is_dir():
            return None  # the first line makes the file the link names
        return (f"{where} is a symbolic link to {os.readlink(path)}, whose folder {folder} does not exist: make that "
                "folder, or remove the link")
    except OSError as e:  # a link loop, a folder on the way without search permission
        return f"{where} cannot be read ({e.strerror or e}); {aside}"
    if stat.S_ISDIR(mode):
        return f"{where} is a folder, not a file; {aside}"
    if not stat.S_ISREG(mode):
        return f"{where} is not a regular file; {aside}"
    if read:
        try:
            path.read_bytes().decode("utf-8")
        except OSError as e:
            return f"{where} cannot be read ({e.strerror or e}); {aside}"
        except UnicodeDecodeError as e:
            # the trainer writes ASCII (json.dumps' default): these bytes are another program's
            return (f"{where} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}), so not a log the "
                    f"trainer wrote; {aside}")
    return None


def check_metrics_file(checkpoint_dir: str, read: bool = True) -> None:
    """RecipeError where checkpoint.dir's metrics.jsonl cannot be the run's metrics log (`metrics_file_problem`)."""
    problem = metrics_file_problem(Path(checkpoint_dir) / METRICS_FILE, read=read)
    if problem:
        raise RecipeError(problem)


def _check_not_an_iteration_folder(checkpoint_dir: str) -> None:
    """RecipeError when checkpoint.dir is one `iter_*` folder of a checkpoint (its metadata inside, or its parent
    the root with the latest pointer): the run found no pointer there, trained from random weights and saved its
    own iterations inside the other run's folder, exit 0."""
    import re

    from megatron_ext.checkpoint_index import METADATA_FILE
    from megatron_ext.checkpoint_layout import LATEST_FILE

    folder = Path(checkpoint_dir)
    if not re.fullmatch(r"iter_\d+", folder.name) or (folder / LATEST_FILE).is_file():
        return  # a root that happens to be named so is one
    parent = folder.parent
    if (folder / METADATA_FILE).is_file() or (parent / LATEST_FILE).is_file():
        raise RecipeError(f"checkpoint.dir = {checkpoint_dir!r} is an iteration folder of the checkpoint {parent}: "
                          f"to resume, give checkpoint.dir={parent}; to start a new run from this iteration, "
                          f"checkpoint.init_from={checkpoint_dir} and a new checkpoint.dir")


def _resumes(checkpoint_dir: str) -> bool:
    """Whether the run resumes from `checkpoint_dir` (its latest pointer is there). Iteration folders without the
    pointer are refused: the trainer would start over (from init_from), drop their metrics and overwrite them."""
    from megatron_ext.checkpoint_layout import LATEST_FILE, available_iterations, iter_dir_name

    root = Path(checkpoint_dir)
    if (root / LATEST_FILE).is_file():
        return True
    its = available_iterations(root) if root.is_dir() else []
    if its:
        raise RecipeError(f"checkpoint.dir = {checkpoint_dir!r} holds {iter_dir_name(its[-1])}"
                          f"{f' and {len(its) - 1} older' if len(its) > 1 else ''} but no {LATEST_FILE} (a copy "
                          "that missed it, or a save that ended between its last two steps): to resume from it, "
                          f"`echo {its[-1]} > {root / LATEST_FILE}`; to start over, give a new checkpoint.dir")
    return False


TE_BACKEND_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _check_attention_backend_variables(recipe: Recipe) -> None:
    """Megatron-Core sets Transformer Engine's NVTE_*_ATTN variables itself from the model's attention backend (fused
    for FP8 attention, else auto: all on) and stops with an AssertionError at any other value already set, e.g.
    NVTE_FLASH_ATTN=0 exported as a TE workaround."""
    import os

    expected = ("0", "1", "0") if recipe.runtime.fp8_attention else ("1", "1", "1")
    wrong = [f"{k}={os.environ[k]}" for k, v in zip(TE_BACKEND_VARIABLES, expected) if os.environ.get(k, v) != v]
    if wrong:
        backend = "fused (cuDNN), for runtime.fp8_attention" if recipe.runtime.fp8_attention else "auto"
        raise RecipeError(f"{', '.join(wrong)} in the environment: Megatron-Core chooses Transformer Engine's "
                          f"attention backend itself (here {backend}) and refuses other values of "
                          f"{', '.join(TE_BACKEND_VARIABLES)}; unset them")


def setup_warnings(recipe: Recipe) -> list[str]:
    """What `launch --check` and the trainer's log warn about before a run: `positions_warning`, `epochs_warning`,
    `sft_length_warning`, `selective_recompute_warning`, `partial_rotary_warning`."""
    return [w for w in (positions_warning(recipe), epochs_warning(recipe), sft_length_warning(recipe),
                        selective_recompute_warning(recipe), partial_rotary_warning(recipe)) if w]


def partial_rotary_warning(recipe: Recipe) -> str | None:
    """rope.partial_rotary_factor != 1: our model rotates part of each head, transformers' Llama all of it, so
    `tools/convert.py to-hf` refuses the checkpoint: said before the run, not after it."""
    factor = recipe.rope.partial_rotary_factor
    if factor == 1.0:
        return None
    return (f"rope.partial_rotary_factor = {factor:g}: transformers' Llama rotates every dimension, so "
            "tools/convert.py to-hf will refuse this run's checkpoints (no Hugging Face Llama matches them)")


def selective_recompute_warning(recipe: Recipe) -> str | None:
    """train.recompute = selective on GPUs: Megatron recomputes the core attention, which under Transformer Engine is
    fused and keeps next to nothing (its inputs, output and a log-sum-exp): no memory saved, its forward paid again."""
    rt = recipe.runtime
    if recipe.train.recompute != "selective" or rt.device != "cuda" or rt.attention == "sdpa":
        return None
    return ("train.recompute = selective recomputes the core attention, which Transformer Engine's fused kernel runs "
            "keeping next to nothing: no memory saved, and the attention forward (most of the FLOPs at long "
            "sequences) runs twice; use train.recompute=none, or full with train.recompute_layers=N (tools/plan.py)")


def sft_length_warning(recipe: Recipe) -> str | None:
    """SFT: a warning when conversations are longer than train.seq_length (data prepared for a longer one): the
    packing leaves them out, which before was one Python warning among the libraries'."""
    from megatron_ext.data.dataset_files import read_index

    if recipe.train.stage != "sft" or recipe.data.prefix is None:
        return None
    L = recipe.train.seq_length
    notes = []
    for prefix in recipe.data.prefixes:
        try:
            lengths = read_index(prefix + ".idx").sequence_lengths
        except (OSError, ValueError):
            continue  # check_data names what is wrong with it
        longer = int((lengths > L).sum())
        if longer:
            notes.append(f"{longer:,} of {lengths.size:,} conversations ({100 * longer / max(lengths.size, 1):.0f}%) "
                         f"of data.prefix {prefix!r} are longer than train.seq_length = {L:,} (up to "
                         f"{int(lengths.max()):,} tokens)")
    if not notes:
        return None
    return ("; ".join(notes) + ": they are left out of the packs; set train.seq_length to the length the data was "
            "prepared for (tools/prepare_data.py sft --seq-length), or prepare it again for this one")


def epochs_warning(recipe: Recipe) -> str | None:
    """CPT: a warning when the run reads more tokens than its train split holds, so GPTDataset repeats some (the
    paper's runs read their data once; 150 steps x 2 x 4M = 1.26B tokens take more than 1B tokens prepared)."""
    from megatron_ext.resume import train_split_tokens

    t = recipe.train
    held = train_split_tokens(recipe) if t.stage == "cpt" else None
    need = t.steps * t.global_batch_size * t.seq_length + 1  # GPTDataset's count: one token more than the samples
    if held is None or need <= held:
        return None
    return (f"train.steps x train.global_batch_size x train.seq_length = {need - 1:,} tokens (+1), but the train split "
            f"of data.prefix holds {held:,}: GPTDataset goes over it {-(-need // held)} times, {need - held:,} tokens "
            f"({100 * (need - held) / need:.1f}% of the run) a second time or more; prepare at least {need:,} "
            "tokens for the train split (tools/prepare_data.py cpt --max-tokens; more with a validation split), or lower "
            "train.steps")


def positions_warning(recipe: Recipe) -> str | None:
    """A warning when the run trains beyond `model.max_position_embeddings`: the checkpoint, its export and the
    evaluation's length check then claim a shorter context than the one trained (usually an override of
    train.seq_length without the model's length and RoPE); None otherwise."""
    seq, positions = recipe.train.seq_length, recipe.max_position_embeddings
    if seq <= positions:
        return None
    return (f"train.seq_length = {seq:,} is beyond model.max_position_embeddings = {positions:,}: the checkpoint and "
            f"its export will claim {positions:,} positions; set model.max_position_embeddings (and the rope block) "
            "for the trained length, e.g. the recipe of that length")


def check_data(recipe: Recipe) -> None:
    """Every `data.prefix` is a complete dataset of this stage's kind with no token id beyond model.vocab_size
    (RecipeError naming the prefix and the fix). Reads each manifest and index with numpy alone."""
    from megatron_ext.data import DataError
    from megatron_ext.data.common import vocabulary_hash
    from megatron_ext.data.dataset_files import (check_complete, check_sft_masks, check_token_ids, missing_file,
                                                 read_manifest)

    if recipe.data.prefix is None:
        raise RecipeError("data.prefix: missing; set the indexed dataset prefix written by tools/prepare_data.py")
    try:  # a local model.tokenizer (a hub name is not fetched here); manifests since 2026-12 record the data's
        vocabulary = vocabulary_hash(_tokenizer_json(recipe.model.tokenizer))
    except (TypeError, KeyError):
        vocabulary = None
    for prefix in recipe.data.prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise RecipeError(f"data.prefix = {prefix!r}: {missing_file(prefix, suffix)}")
        try:
            manifest = read_manifest(prefix, recipe.train.stage)
            if vocabulary and manifest.get("vocabulary_hash", vocabulary) != vocabulary:
                # the run would learn one tokenizer's ids while the checkpoint records (and the export ships) the other
                raise RecipeError(f"data.prefix = {prefix!r} was tokenized with {manifest.get('tokenizer')!r}, whose "
                                  f"vocabulary is not that of model.tokenizer = {recipe.model.tokenizer!r}: set "
                                  "model.tokenizer to the data's tokenizer, or prepare the data again with this one")
            check_token_ids(prefix, manifest, recipe.model.vocab_size)
            # a truncated .bin/.idx (or SFT loss mask) fails here, not mid-training
            check_sft_masks(prefix) if recipe.train.stage == "sft" else check_complete(prefix)
        except DataError as e:
            raise RecipeError(str(e)) from None


def _tokenizer_json(tokenizer: str | None) -> dict | None:
    """The parsed `tokenizer.json` of a local tokenizer folder (read without transformers); None for a hub name,
    a folder without one, or a file that is not JSON."""
    import json

    if tokenizer is None:
        return None
    try:
        return json.loads((Path(tokenizer).expanduser() / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _largest_token_id(data: dict | None) -> int | None:
    """The largest id a fast tokenizer's `tokenizer.json` (parsed) makes (its model's vocabulary and added tokens);
    None when it is not of that form."""
    try:
        vocab = data["model"]["vocab"]
        ids = [len(vocab) - 1] if isinstance(vocab, list) else list(vocab.values())
        ids += [t["id"] for t in data.get("added_tokens") or []]
        return max(int(i) for i in ids) if ids else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _check_folder_can_be_made(name: str, path: str) -> None:
    """The run makes its output folders only after building the model (or dies half-way, leaving empty folders):
    find the nearest part of the path that exists and try making a folder there, removed at once."""
    import os
    import tempfile

    out = Path(path)
    there = out.absolute()
    while not os.path.lexists(there):
        there = there.parent
    if not there.is_dir():
        where = "is a file" if there == out.absolute() else f"lies under {there}, which is a file"
        raise RecipeError(f"{name} = {str(out)!r}: {where}, not a folder; give a folder path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_test_", dir=there))
    except OSError as e:
        raise RecipeError(f"{name} = {str(out)!r}: cannot make folders in {there} ({e.strerror}); give a "
                          "writable folder path") from None


def out_of_memory(error: BaseException) -> str | None:
    """torch's words for an allocation that failed, on a GPU (torch.OutOfMemoryError) or on the CPU (its
    allocator's RuntimeError); None for any other error."""
    import torch

    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):  # "CUDA out of memory. Tried to allocate X. GPU 0 has ..."
        return ". ".join(text.split(". ")[:3]).strip()
    if isinstance(error, RuntimeError) and "DefaultCPUAllocator" in text:
        return text[text.index("DefaultCPUAllocator"):].split(" Error code")[0].strip()
    return None


def out_of_memory_advice(recipe: Recipe, recipe_path: str, overrides: list[str], world_size: int) -> str:
    """What to change when `recipe` ran out of device memory on `world_size` ranks, with the planner command that
    itemises its memory."""
    import shlex

    p, t = recipe.parallel, recipe.train
    plan = ""
    if recipe.runtime.device == "cuda":  # the planner models GPUs
        words = ["python", "tools/plan.py", recipe_path, "--gpus", str(world_size),
                 *(a for o in overrides for a in ("--set", o))]
        plan = f"`{shlex.join(words)}{'' if recipe.cluster.gpu else ' --gpu GPU'}` shows the memory by part: "
    return (f"the model, its optimizer state and the activations of train.micro_batch_size = {t.micro_batch_size} x "
            f"{t.seq_length} tokens do not fit at TP {p.tensor} x PP {p.pipeline} x CP {p.context} with "
            f"train.recompute = {t.recompute}; {plan}raise parallel.context (or tensor / pipeline), set "
            "train.recompute=full, or lower train.micro_batch_size")
