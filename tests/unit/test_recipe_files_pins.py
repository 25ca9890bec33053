"""Pins of reading recipe files (megatron_ext.recipe_files) from the mutation audit (round 7): what a path that is no
regular file is said to be, `extends:` values that are no path and cycles spelled through other paths, and a file
whose top level is no mapping; each a one-line RecipeError, not a traceback."""

import os

import pytest

from megatron_ext.recipe_files import resolve_extends
from megatron_ext.recipe_schema import RecipeError


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_is_named_a_pipe(tmp_path):
    """A named pipe given as the recipe (a shell's <(...) is one) is said to be a pipe (RF11)."""
    os.mkfifo(tmp_path / "r.yaml")
    with pytest.raises(RecipeError, match=r"r\.yaml' is not a regular file but a pipe; give the path to a \.yaml"):
        resolve_extends(tmp_path / "r.yaml")


def test_a_cycle_through_another_spelling_of_the_path(tmp_path):
    """`extends: ../d/a.yaml` in d/a.yaml is a.yaml itself: a cycle, said as one, not a RecursionError (the paths
    are compared resolved: RF5)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.yaml").write_text("extends: ../d/a.yaml\n")
    with pytest.raises(RecipeError, match=r"`extends` forms a cycle through"):
        resolve_extends(tmp_path / "d" / "a.yaml")


def test_extends_that_is_no_path(tmp_path):
    """`extends: 5` is refused naming the file and the field (RF8: a TypeError from `Path / 5`; RF15: the file
    left unnamed)."""
    (tmp_path / "r.yaml").write_text("extends: 5\n")
    with pytest.raises(RecipeError) as e:
        resolve_extends(tmp_path / "r.yaml")
    assert str(e.value) == "r.yaml: extends = 5: expected a path to another recipe, relative to this file"


def test_a_top_level_list(tmp_path):
    """A file that is a YAML list is no recipe: said so, with what it is (RF17: an AttributeError from `.pop`)."""
    (tmp_path / "r.yaml").write_text("- train\n- data\n")
    with pytest.raises(RecipeError, match=r"r\.yaml': top level must be a mapping of sections, got list$"):
        resolve_extends(tmp_path / "r.yaml")


def _message(path):
    with pytest.raises(RecipeError) as e:
        resolve_extends(path)
    return str(e.value)


def test_links_are_named_as_given(tmp_path):
    """Round 9: a link to nowhere is said to be one, by the path given (RF2: 'not found'; RF11: the target named
    'not found'); a link to a pipe (/dev/stdin is one when input is piped) is a pipe, not a link to nowhere (RF15)."""
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "nowhere.yaml")
    assert _message(tmp_path / "gone.yaml") == (f"recipe file {str(tmp_path / 'gone.yaml')!r} is a link to "
                                                f"{tmp_path / 'nowhere.yaml'}, which does not exist; give the path to "
                                                "a .yaml recipe (see recipes/)")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        (tmp_path / "r.yaml").symlink_to(tmp_path / "fifo")
        assert _message(tmp_path / "r.yaml") == (f"recipe file {str(tmp_path / 'r.yaml')!r} is not a regular file but "
                                                 "a pipe; give the path to a .yaml recipe (see recipes/)")


def test_values_that_are_no_recipe_values(tmp_path):
    """Round 9, product bug: `name: 2024-06-01` is a YAML date, and an alias inside its own anchor a value that holds
    itself; `recipe check`, launch and the trainer failed with a traceback (TypeError 'Object of type date is not JSON
    serializable' / ValueError 'Circular reference detected' from load_recipe's JSON copy). Now one line naming the
    field. Control (old code): those tracebacks. The alias one is also RS1 (a RecursionError)."""
    from megatron_ext.recipe import load_recipe

    r = tmp_path / "r.yaml"
    r.write_text("name: 2024-06-01\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(r)  # where the traceback came from
    assert str(e.value) == (f"recipe file {str(r)!r}: name = datetime.date(2024, 6, 1): YAML read a date, which no "
                            "recipe field takes; quote it: name: '2024-06-01'")
    r.write_text("data: {prefix: [a, !!binary aGVsbG8=]}\n")
    assert _message(r) == f"recipe file {str(r)!r}: data.prefix[1] = b'hello': YAML read a bytes, which no recipe " \
                          "field takes"
    r.write_text("train: &t {x: [*t]}\n")
    assert _message(r) == f"recipe file {str(r)!r}: train.x[0]: an alias inside its own anchor (a value that holds " \
                          "itself); write the value out"
    r.write_text("a: &a {x: [1]}\nb: [*a, *a]\n")  # an anchor used twice is fine
    assert resolve_extends(r) == {"a": {"x": [1]}, "b": [{"x": [1]}, {"x": [1]}]}


@pytest.mark.parametrize("value, said", [("false", "False"), ("[]", "[]"), ("0", "0")])
def test_extends_that_is_empty_but_not_null(tmp_path, value, said):
    """Round 9: `extends: false` / `[]` / `0` is refused like any value that is no path (RF19: taken for no
    `extends` at all, the file loaded alone)."""
    (tmp_path / "r.yaml").write_text(f"extends: {value}\n")
    assert _message(tmp_path / "r.yaml") == f"r.yaml: extends = {said}: expected a path to another recipe, relative " \
                                            "to this file"


def test_aliases_that_expand_to_billions_are_refused_at_once(tmp_path):
    """Aliases of aliases (9 levels of 9: 387 million values) made load_recipe's JSON copy write every value out:
    8 levels took 24 s and 1.4 GB in `recipe check`, 9 would take minutes and ~12 GB. Now one line before anything
    is expanded; the count is linear in the file. Controls: the same file with 4 levels (7,381 values) loads, and an
    alias inside its own anchor is still said as one."""
    import time

    from megatron_ext.recipe import load_recipe
    from megatron_ext.recipe_schema import MAX_EXPANDED_VALUES

    def laughs(levels: int) -> str:
        lines = ['x0: &x0 ["a","a","a","a","a","a","a","a","a"]']
        lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]" for i in range(1, levels)]
        return "\n".join(lines) + "\n"

    r = tmp_path / "r.yaml"
    r.write_text(laughs(9))
    began = time.monotonic()
    with pytest.raises(RecipeError) as e:
        load_recipe(r)
    assert str(e.value) == (f"recipe file {str(r)!r}: its YAML aliases (*name) expand to more than "
                            f"{MAX_EXPANDED_VALUES:,} values, where a recipe holds a few hundred; write the values out "
                            "or use fewer aliases")
    assert time.monotonic() - began < 10
    r.write_text(laughs(4))
    assert len(resolve_extends(r)["x3"]) == 9 and resolve_extends(r)["x3"][8][8][8] == ["a"] * 9
    r.write_text("train: &t {x: [*t]}\n")
    assert "an alias inside its own anchor" in _message(r)
