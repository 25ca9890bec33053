"""Reading recipe files: the path checked to be a regular file (or told what it is instead), its YAML read as a
mapping of sections, and the `extends:` chain merged, parent under child. Works on the raw dict, before overrides,
model sources and the schema."""

from __future__ import annotations

import datetime
import os
import stat
from pathlib import Path
from typing import Any

from megatron_ext.recipe_schema import RecipeError, bad_value, load_yaml_mapping


def _not_a_file(path: Path) -> str:
    """What `path`, not a regular file, is instead: /dev/null was 'not found', which it is not."""
    if path.is_dir():
        return "is a folder"
    if path.is_symlink() and not path.exists():
        return f"is a link to {os.readlink(path)}, which does not exist"
    try:
        mode = path.stat().st_mode
    except OSError:
        return "not found"
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
             (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "something else")
    return f"is not a regular file but {kind}"


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} {_not_a_file(path)}; give the path to a .yaml recipe "
                          "(see recipes/)")


def _not_plain(value: Any, where: str, open_: set[int], done: set[int]) -> str | None:
    """What in `value` (read at `where`) no recipe value can be, said in a line, or None: a YAML date, timestamp,
    binary or set (`name: 2024-06-01` is a date), or an alias inside its own anchor (a value that holds itself).
    They failed later as a TypeError / ValueError traceback from the recipe's JSON copy."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    if not isinstance(value, (dict, list)):
        quote = f"; quote it: {where.rsplit('.', 1)[-1]}: '{value}'" if isinstance(value, datetime.date) else ""
        return f"{where} = {value!r}: YAML read a {type(value).__name__}, which no recipe field takes{quote}"
    if id(value) in done:  # an alias of a value already checked
        return None
    if id(value) in open_:
        return f"{where}: an alias inside its own anchor (a value that holds itself); write the value out"
    open_.add(id(value))
    for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
        sub = f"{where}[{key}]" if isinstance(value, list) else f"{where}.{key}" if where else str(key)
        problem = (_not_plain(key, sub, open_, done) if isinstance(value, dict) else None) or \
            _not_plain(item, sub, open_, done)
        if problem:
            return problem
    open_.discard(id(value))
    done.add(id(value))
    return None


def _read_yaml(path: Path) -> dict:
    _check_file(path)
    try:
        raw = load_yaml_mapping(path.read_text(encoding="utf-8"), f"recipe file {str(path)!r}")
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe file {str(path)!r} is not UTF-8 text (byte {e.start}); give a .yaml recipe") \
            from None
    if raw is None:  # not `{}`: "train.seq_length: missing required field" would hide that the file is empty
        raise RecipeError(f"recipe file {str(path)!r} is empty (no settings, or comments alone); write the recipe "
                          "in it, or give another file (see recipes/)")
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe file {str(path)!r}: top level must be a mapping of sections, got {type(raw).__name__}")
    problem = _not_plain(raw, "", set(), set())
    if problem:
        raise RecipeError(f"recipe file {str(path)!r}: {problem}")
    return raw


def _merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for key, value in child.items():
        # The rope fields only make sense together (a yarn child must not inherit llama3's freq factors).
        if key != "rope" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_extends(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The raw mapping of the recipe file `path` with the files its `extends:` chain names merged under it."""
    _check_file(path)  # as given: resolved, a link to nowhere or a pipe (/dev/fd/63) is named by what it points to
    path = path.resolve()
    if path in seen:
        raise RecipeError(f"recipe {str(path)!r}: `extends` forms a cycle through {[str(p) for p in seen]}")
    raw = _read_yaml(path)
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise bad_value(f"{path.name}: extends", parent, "a path to another recipe, relative to this file")
    return _merge(resolve_extends(path.parent / parent, seen + (path,)), raw)
