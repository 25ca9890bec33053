"""A checkpoint root's folder layout, from plain file reads (no torch here):

    ROOT/latest_checkpointed_iteration.txt   the latest finished iteration (Megatron-LM's pointer file)
    ROOT/iter_0000010/                       one finished save (megatron_ext.checkpoint writes it)
    ROOT/.iter_0000010.partial/              a save still being written, or interrupted
    ROOT/.iter_0000010.old/                  while iteration 10 is saved again (between two renames)
    ROOT/.iter_0000002.deleting/             an iteration being pruned (checkpoint.keep_last)

The iteration folders, the latest pointer and our metadata file (`megatron_ext.json`) in an iteration.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from megatron_ext.checkpoint_index import METADATA_FILE, CheckpointError, check_complete

LATEST_FILE = "latest_checkpointed_iteration.txt"


def iter_dir_name(iteration: int) -> str:
    """`iter_0000010` for iteration 10: Megatron-LM's name of an iteration folder."""
    return f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    """Iteration named by `root/latest_checkpointed_iteration.txt`, or None if there is none."""
    path = Path(root) / LATEST_FILE
    if not path.is_file():
        return None
    # bytes that are not UTF-8 (a torn write, a disk fault) are the same mistake as 'abc': one CheckpointError
    # naming the file, not a UnicodeDecodeError traceback
    text = path.read_bytes().decode("utf-8", errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}; "
                              "fix or delete the file") from None


def available_iterations(root: Path) -> list[int]:
    """Iterations with an `iter_*` folder in `root`, ascending (whatever the latest pointer says)."""
    its = []
    for p in root.glob("iter_*"):
        try:
            its.append(int(p.name[5:]))
        except ValueError:
            continue
        if not p.is_dir():  # a stray file of that name is no iteration
            its.pop()
    return sorted(its)


def unfinished_saves(root: Path) -> list[int]:
    """Iterations whose save is still being written (in the background) or was interrupted, ascending:
    their temporary folders, which nothing loads and the next save of that iteration replaces."""
    its = []
    for p in Path(root).glob(".iter_*.partial"):
        try:
            its.append(int(p.name[6:-8]))
        except ValueError:
            pass
    return sorted(its)


def complete_soon(path: Path, waits: tuple[float, ...] = (2, 5)) -> None:
    """`check_complete(path)`, tried again after each of `waits` seconds: a shared file system may show other nodes'
    files a moment late (a save's last check, on rank 0)."""
    for wait_s in waits:
        try:
            return check_complete(path)
        except CheckpointError:
            time.sleep(wait_s)
    check_complete(path)


def checkpoints_inside(folder: Path) -> list[Path]:
    """The checkpoint roots (with the latest pointer) one level below `folder`, by name: what was meant when a
    tool was given the folder above a run's checkpoint.dir (`runs` for `runs/cpt`)."""
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and (p / LATEST_FILE).is_file())
    except OSError:  # unreadable: nothing to suggest
        return []


def not_a_root(folder: Path, field: str | None = None, iteration_option: str | None = None) -> str:
    """'(found iterations: ...); what to give instead' for `folder`, which has no latest pointer: its latest
    `iter_*` folder (which every reader takes) or, where the tool has one, `iteration_option` N; else the checkpoints
    one level below it; else the folder that holds iter_* folders. `field`: the recipe field it was given as
    ('give FIELD=PATH'), else a command line's argument ('pass PATH')."""
    its = available_iterations(folder)
    if its:
        latest = folder / iter_dir_name(its[-1])
        fix = f"give {field}={latest}" if field else f"pass {latest}" + (
            f", or {iteration_option} {its[-1]}" if iteration_option else "")
        return f"(found iterations: {its}); {fix}"
    inner = checkpoints_inside(folder)
    if len(inner) == 1:
        return f"(found iterations: none); {inner[0]} is a checkpoint: " + (
            f"give {field}={inner[0]}" if field else "pass it")
    if inner:
        shown = ", ".join(map(str, inner[:4])) + (f" and {len(inner) - 4} more" if len(inner) > 4 else "")
        return f"(found iterations: none); {shown} are checkpoints: " + (
            f"give one of them as {field}" if field else "pass one of them")
    return "(found iterations: none); " + (
        "give the folder that holds iter_* (its latest iteration) or one iter_* folder (tools/convert.py to-megatron "
        "writes one)" if field else "pass the directory that holds iter_* folders")


def resolve_iteration_dir(root: str | Path, iteration: int | None = None,
                          iteration_option: str | None = None) -> tuple[int, Path]:
    """(iteration, directory) of a checkpoint root (`iteration=None`: its latest), or of one of its `iter_*`
    folders given itself (an earlier iteration, e.g. to start SFT or an evaluation from). `iteration_option`: the
    caller's option that names an iteration (`--iteration`), suggested with the iteration folder when `root` has
    iter_* folders but no latest pointer."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is a file; give the folder that holds iter_* (or one "
                              "iter_* folder)")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist; check the path")
    named = re.fullmatch(r"iter_(\d+)", root.name)
    if named and not (root / LATEST_FILE).exists():
        if iteration is not None and iteration != int(named[1]):
            raise CheckpointError(f"{root} is iteration {int(named[1])}, not the iteration {iteration} asked for; "
                                  "give the checkpoint root with an iteration, or an iteration folder alone")
        return int(named[1]), root
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None and (root / "config.json").is_file() and not available_iterations(root):
            raise CheckpointError(f"{root} is a Hugging Face model folder (config.json), not a Megatron checkpoint "
                                  "(no iter_* folders)")
        if iteration is None:
            raise CheckpointError(f"{root} has no {LATEST_FILE}: it is not a Megatron checkpoint root "
                                  f"{not_a_root(root, iteration_option=iteration_option)}")
    path = root / iter_dir_name(iteration)
    if not path.is_dir():
        kept = root / f".{path.name}.old"  # a save of the same iteration again, stopped between its two renames
        hint = (f"; {kept.name} holds it from a save of iteration {iteration} again that was stopped: rename it to "
                f"{path.name}") if kept.is_dir() else ""
        raise CheckpointError(f"{root} has no iteration {iteration} ({path.name}); "
                              f"available: {available_iterations(root) or 'none'}{hint}")
    return iteration, path


def read_metadata(path: str | Path) -> dict:
    """Our JSON metadata of a checkpoint: `path` is an `iter_*` directory or a root (then its latest)."""
    path = Path(path)
    if not (path / METADATA_FILE).is_file() and (path / LATEST_FILE).is_file():
        _, path = resolve_iteration_dir(path)
    file = path / METADATA_FILE
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist: {path} was not written by megatron_ext.checkpoint "
                              "(or is not a checkpoint directory)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the checkpoint metadata is corrupt") from None


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def carry_forward(metadata: dict, source: dict) -> None:
    """Take over into a run's `metadata` what the checkpoint it starts from (`source`: that one's metadata) knows and
    the recipe does not: the model's tokenizer, generation config and bos/eos/pad ids. Without them an export of a
    trained stage had an empty generation_config.json and transformers' Llama-2 eos id (2): generate() never
    stopped at <|eot_id|>. A tokenizer folder beats a hub name (the recipe's usual one): an export copies files."""
    ours, theirs = metadata.get("tokenizer"), source.get("tokenizer")
    if theirs and (ours is None or (not Path(ours).expanduser().is_dir() and Path(theirs).is_dir())):
        metadata["tokenizer"] = theirs
    metadata["generation_config"] = metadata.get("generation_config") or source.get("generation_config")
    cfg, known = metadata["hf_config"], source.get("hf_config") or {}
    for key in TOKEN_ID_KEYS:
        if cfg.get(key) is None and known.get(key) is not None:
            cfg[key] = known[key]


def checked_metadata(path: Path) -> dict:
    """The metadata of the `iter_*` folder `path` (`read_metadata`), or a CheckpointError naming its file when it is
    not what every save writes: a JSON object with the model's `hf_config`, and objects where it has a recipe, the
    recipe's train block, versions and layout. Damaged, it gave tracebacks or a description of nothing ('? layers')."""
    file = path / METADATA_FILE
    try:
        meta = read_metadata(path)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text ({e}); the checkpoint metadata is corrupt") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file} holds a JSON {type(meta).__name__}, not an object; the checkpoint metadata "
                              "is corrupt")
    if not isinstance(meta.get("hf_config"), dict):  # in the words of the converter and the evaluation engine
        raise CheckpointError(f"{path}: metadata has no hf_config; cannot tell the architecture ({file} was not "
                              "written by megatron_ext.checkpoint, or is damaged)")
    sections = {key: meta.get(key) for key in ("recipe", "versions", "parallel")}
    if isinstance(meta.get("recipe"), dict):
        sections["recipe.train"] = meta["recipe"].get("train")
    for key, value in sections.items():
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"{file}: {key} is a JSON {type(value).__name__}, not an object; the checkpoint "
                                  "metadata is corrupt")
    return meta
