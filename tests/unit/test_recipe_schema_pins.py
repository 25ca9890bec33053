"""Pins of the typed recipe schema (megatron_ext.recipe_schema) from the mutation audit (round 9): the exact one-line
error a wrong value, an unknown key or a bad YAML file gets, and that the YAML read is what yaml.safe_load reads (merge
keys, keys of other types, keys twice inside lists)."""

import dataclasses

import pytest
import yaml

from megatron_ext.recipe import RecipeError, RopeConfig, load_recipe
from megatron_ext.recipe_schema import load_yaml_mapping
from tests.unit.test_recipe import BASE


def error(overrides=(), raw=None, path=None):
    with pytest.raises(RecipeError) as e:
        if path is not None:
            load_recipe(path)
        else:
            load_recipe(raw=raw if raw is not None else BASE, overrides=list(overrides))
    return str(e.value)


@pytest.mark.parametrize("override, message", [
    # an Optional integer: one message for the field, not a TypeError from trying `null` as a type (RS36), and an
    # integer is called one (RS12, RS15)
    ("checkpoint.keep_last=abc", "checkpoint.keep_last = 'abc': expected an integer or null"),
    # a string is no list, not even of one-letter numbers (RS16: weights (1.0, 2.0)); the list's items named (RS11)
    ("data.weights='12'", "data.weights = '12': expected a list of a number or null"),
    # the item of a list is named by its 0-based index (RS17)
    ("profile.ranks=[0, x]", "profile.ranks[1] = 'x': expected an integer"),
    # true is no number, although Python's bool is an int (RS22)
    ("train.lr=true", "train.lr = True: expected a number"),
    # true is no string, and quoting is advised for numbers only (RS24)
    ("data.split=true", "data.split = True: expected a string"),
    # a top-level key is named without a leading dot (RS27)
    ("trian.lr=1", "trian: unknown key (did you mean 'train'?); valid keys here: name, model, rope, parallel, cluster, "
                   "train, data, checkpoint, runtime, profile"),
])
def test_one_line_errors(override, message):
    assert error([override]) == message


def test_no_far_fetched_suggestion_for_an_unknown_key():
    """A key like no valid one (`nodes`, a cluster key, under train) gets no 'did you mean' (difflib's own cutoff;
    RS26 suggested 'adam_eps')."""
    assert error(["train.nodes=2"]).startswith("train.nodes: unknown key; valid keys here: stage, seq_length, ")


def test_a_section_given_as_a_value_lists_its_keys():
    """`rope: ultralong-1m` (for `rope: {preset: ultralong-1m}`) names the keys a rope block has (RS35), not a
    TypeError from a string's `in` (RSO28)."""
    keys = [f.name for f in dataclasses.fields(RopeConfig)]
    assert error(raw={**BASE, "rope": "ultralong-1m"}) == f"rope = 'ultralong-1m': expected a mapping with keys {keys}"


def test_a_whole_number_written_as_a_float_is_an_integer():
    """`train.steps: 1000.0` is 1000 steps (RS21 refused it); 1000.5 is refused (test_recipe)."""
    steps = load_recipe(raw=BASE, overrides=["train.steps=1000.0"]).train.steps
    assert steps == 1000 and type(steps) is int


def test_yaml_errors_say_the_problem_and_its_context(tmp_path):
    """What PyYAML says, whole: the problem with its context (RS8), and for an error with no `problem` (a control
    character, a ReaderError) the first line of its text (RS37: 'None')."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    assert error(path=bad) == (f"recipe file {str(bad)!r} line 2 column 1: not valid YAML: expected ',' or ']', but "
                               "got '<stream end>' (while parsing a flow sequence)")
    bad.write_text("name: a\x07b\n")
    with pytest.raises(yaml.YAMLError) as e:
        yaml.safe_load(bad.read_text())
    said = str(e.value).splitlines()[0]
    assert said == "unacceptable character #x0007: special characters are not allowed"
    assert error(path=bad) == f"recipe file {str(bad)!r}: not valid YAML: {said}"


@pytest.mark.parametrize("text", [
    "a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: *a\n  <<: *b\n",  # two merge keys: both merged, nothing lost (RS2)
    "1: a\n'1': b\n",  # the integer 1 and the string '1' are two keys (RS39)
    "a: &a [1, 2]\nb: [*a, *a]\nc: *a\n",  # an anchor used again is no key given twice
])
def test_what_yaml_reads_is_read(text):
    assert load_yaml_mapping(text, "t") == yaml.safe_load(text)


def test_a_key_twice_inside_a_list_is_refused():
    """Mappings inside lists are checked too (RS6: the second x silently won)."""
    with pytest.raises(RecipeError) as e:
        load_yaml_mapping("a:\n  - {x: 1, x: 2}\n", "t")
    assert str(e.value) == "t line 2 column 12: not valid YAML: key 'x' given twice (first on line 2); keep one"
