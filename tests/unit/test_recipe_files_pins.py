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
