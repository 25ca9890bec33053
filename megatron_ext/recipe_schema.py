"""Typed recipe mappings: YAML values -> frozen dataclasses, with one clear error per mistake.

`build(cls, raw)` checks every key of `raw` against the dataclass fields (unknown keys name the closest valid
one), coerces each value to the field's type (Literal, Optional, tuple, bool, int, float, str, nested
dataclasses) and reports missing required fields with their docstring (`metadata["doc"]`). `load_yaml_mapping`
reads the YAML itself with yaml.safe_load, and a key given twice in one mapping is an error (PyYAML keeps the last
silently).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin

import yaml


class RecipeError(ValueError):
    """A user mistake in a recipe or override: the message names the field, the value and the fix."""


def _repeated_key(node: yaml.Node | None, seen_nodes: set[int]) -> tuple[str, yaml.Mark, int] | None:
    """The first key given twice in one mapping of a composed YAML document: (key, where, line of the first), or None.
    Read from the node tree as written, before `<<` merges (whose keys a mapping may give again) are applied."""
    if node is None or id(node) in seen_nodes:  # an alias is the anchored node again
        return None
    seen_nodes.add(id(node))
    children: list = []
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if (key.tag, key.value) in first:
                    return key.value, key.start_mark, first[key.tag, key.value]
                first[key.tag, key.value] = key.start_mark.line
            children += [key, value]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    for child in children:
        found = _repeated_key(child, seen_nodes)
        if found:
            return found
    return None


MAX_EXPANDED_VALUES = 100_000  # a recipe holds a few hundred; YAML aliases of aliases can stand for billions


def _expanded_values(node: yaml.Node | None, sizes: dict[int, int]) -> int:
    """How many values `node` stands for once every alias in it is written out (what the recipe's JSON copy makes).
    Memoised by node, so counting is linear in the document; an alias inside its own anchor counts once here
    (recipe_files refuses it by name)."""
    if node is None:
        return 0
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 1  # while open: a node reached again from inside itself
    children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
        node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1
    for child in children:
        total += _expanded_values(child, sizes)
        if total > MAX_EXPANDED_VALUES:
            break
    sizes[id(node)] = total
    return total


def load_yaml_mapping(text: str, what: str) -> Any:
    """`text` parsed with yaml.safe_load, refusing a key given twice in one mapping (PyYAML keeps the last silently)
    and aliases that expand past MAX_EXPANDED_VALUES values; a mistake is a RecipeError naming `what`, the line and
    column where there is one, and the problem."""
    try:
        document = yaml.compose(text, Loader=yaml.SafeLoader)
        if _expanded_values(document, {}) > MAX_EXPANDED_VALUES:
            raise RecipeError(f"{what}: its YAML aliases (*name) expand to more than {MAX_EXPANDED_VALUES:,} values, "
                              "where a recipe holds a few hundred; write the values out or use fewer aliases")
        repeated = _repeated_key(document, set())
        if repeated is None:
            return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise RecipeError(f"{what}{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")) from None
    key, mark, first_line = repeated
    raise RecipeError(f"{what} line {mark.line + 1} column {mark.column + 1}: not valid YAML: key {key!r} given twice "
                      f"(first on line {first_line + 1}); keep one")


def type_name(tp: Any) -> str:
    """A field type in the words of an error message: `one of 'p2p', 'a2a'`, `an integer or null`."""
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        return f"a list of {type_name(get_args(tp)[0])}"
    return {type(None): "null", int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def bad_value(path: str, value: Any, expected: str) -> RecipeError:
    """`PATH = VALUE: expected EXPECTED`."""
    return RecipeError(f"{path} = {value!r}: expected {expected}")


def coerce(value: Any, tp: Any, path: str, required: frozenset[str] = frozenset()) -> Any:
    """`value` as type `tp` (dataclass, Literal, Optional/Union, tuple, bool, int, float or str).

    RecipeError naming `path` when it is not one; `required` is passed on to nested dataclasses.
    """
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise bad_value(path, value, f"a mapping with keys {[f.name for f in fields(tp)]}")
        return build(tp, value, path, required)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, path, required)
            except RecipeError:
                pass
        raise bad_value(path, value, type_name(tp))
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise bad_value(path, value, type_name(tp))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad_value(path, value, type_name(tp))
        return tuple(coerce(v, get_args(tp)[0], f"{path}[{i}]", required) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad_value(path, value, "true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad_value(path, value, "an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-5` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise bad_value(path, value, "a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML read `split: 100` as a number
            raise bad_value(path, value, f"a string; quote it: {path.rsplit('.', 1)[-1]}: '{value}'")
        raise bad_value(path, value, "a string")
    raise TypeError(f"unsupported recipe field type {tp!r} at {path}")


def unknown_key(path: str, key: str, valid: list[str]) -> RecipeError:
    """`PATH.KEY: unknown key (did you mean ...?); valid keys here: ...`."""
    near = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    where = f"{path}.{key}" if path else key
    return RecipeError(f"{where}: unknown key{hint}; valid keys here: {', '.join(valid)}")


def build(cls: type, raw: dict, path: str = "", required: frozenset[str] = frozenset()) -> Any:
    """The frozen dataclass `cls` from the mapping `raw` found at `path`.

    Unknown keys, wrong types and missing `required` field paths (e.g. `train.steps`) are RecipeErrors.
    """
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    for key in raw:
        if key not in valid:
            raise unknown_key(path, str(key), valid)
    kwargs = {}
    for f in fields(cls):
        sub = f"{path}.{f.name}" if path else f.name
        if f.name in raw:
            kwargs[f.name] = coerce(raw[f.name], hints[f.name], sub, required)
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], {}, sub, required)
        elif sub in required:
            raise RecipeError(f"{sub}: missing required field ({type_name(hints[f.name])}: {f.metadata['doc']})")
    return cls(**kwargs)
