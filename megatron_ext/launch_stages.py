"""The stages of a `launch --stages` chain: which recipe each runs with which overrides, and how a stage follows
the one before it (an SFT stage starts from the checkpoint the stage before it writes, with the same RoPE)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_ext.recipe import Recipe, RecipeError, parse_override


@dataclass
class Stage:
    """One job of the chain: the recipe file and the overrides it runs with."""

    name: str
    recipe: str
    overrides: list[str] = field(default_factory=list)
    own: list[str] = field(default_factory=list)  # the `STAGE:key=value` ones, also in `overrides`


def _stage_folder(base: str) -> Path:
    """Where stage names are looked up: `base` if it is a folder, else the folder of the recipe `base`."""
    return Path(base) if Path(base).is_dir() else Path(base).parent


def stage_recipe(base: str, name: str) -> str:
    """`sft` -> `<folder of base>/sft.yaml` (base: a recipe, or its folder); a name ending in .yaml/.yml is a path."""
    if name.endswith((".yaml", ".yml")):
        return name
    return str(_stage_folder(base) / f"{name}.yaml")


def plan_stages(recipe: str, stages: str | None, overrides: list[str]) -> list[Stage]:
    """Stages in order with their overrides (`STAGE:key=value` only for STAGE)."""
    names = [s.strip() for s in stages.split(",") if s.strip()] if stages else [Path(recipe).stem]
    plan = [Stage(Path(n).stem, stage_recipe(recipe, n) if stages else recipe) for n in names]
    missing = [s for s in plan if not Path(s.recipe).is_file()]
    if stages and missing:
        folder = _stage_folder(recipe)
        available = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise RecipeError(f"--stages {stages}: stage {missing[0].name!r} has no recipe {missing[0].recipe!r}; a stage "
                          f"is a recipe name of {str(folder)!r} without .yaml ({available}), or a path to a .yaml file")
    known = {s.name for s in plan}
    for text in overrides:
        m = re.match(r"^([A-Za-z0-9_.-]+):(.+)$", text)
        if m and "=" not in m.group(1):
            if m.group(1) not in known:
                raise RecipeError(f"override {text!r}: no stage named {m.group(1)!r}; stages are {sorted(known)}")
            for s in plan:
                if s.name == m.group(1):
                    s.overrides.append(m.group(2))
                    s.own.append(m.group(2))
        else:
            for s in plan:
                s.overrides.append(text)
    return plan


def chain_sft_stage(before: Recipe, recipe: Recipe, stage: Stage) -> bool:
    """An SFT stage fine-tunes what the stage before it wrote: its `checkpoint.init_from` becomes that stage's
    `checkpoint.dir` (an override added to `stage`, so the job runs with it) unless the user set init_from for it.
    Without this, `--stages cpt_4m,sft` would fine-tune sft.yaml's own init_from, the 1M model. True if added."""
    written = before.checkpoint.dir
    # Only `STAGE:checkpoint.init_from=...` counts: one given for every stage names the first stage's start.
    given = any(_sets_init_from(*parse_override(o)) for o in stage.own)
    init = recipe.checkpoint.init_from
    if recipe.train.stage != "sft" or written is None or given or (
            init is not None and Path(init).absolute() == Path(written).absolute()):
        return False
    quoted = written if yaml.safe_load(written) == written else json.dumps(written)  # `2024`, `null`: a path
    stage.overrides.append(f"checkpoint.init_from={quoted}")
    print(f"stage {stage.name} starts from {written!r}, which stage {before.name} writes (its recipe's "
          f"checkpoint.init_from is {init!r})", file=sys.stderr)
    return True


def _sets_init_from(keys: list[str], value) -> bool:
    """Whether the override `keys=value` sets checkpoint.init_from (`checkpoint.init_from=X`, `checkpoint={...}`)."""
    return keys == ["checkpoint", "init_from"] or (keys == ["checkpoint"] and isinstance(value, dict)
                                                    and "init_from" in value)


def check_stage_follows(before: Recipe, stage: Recipe) -> None:
    """A stage should start from the checkpoint of the stage before it (a warning when its checkpoint.init_from
    is another), and keep its RoPE: an SFT must (RecipeError: `--stages cpt_4m,sft_4m`, not `sft`, whose rope is
    the 1M model's); a CPT stage may extend it further (a warning)."""
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.resume import rope_changes

    init, written = stage.checkpoint.init_from, before.checkpoint.dir
    if written is None:
        return
    if init is None or Path(init).absolute() != Path(written).absolute():
        print(f"warning: stage {stage.name} starts from checkpoint.init_from = {init!r}, not from {written!r}, which "
              f"stage {before.name} writes; to chain them add {stage.name}:checkpoint.init_from={written}",
              file=sys.stderr)
        return
    changes = rope_changes(hf_config_from_recipe(before), stage)
    if not changes:
        return
    what = (f"stage {stage.name} starts from the checkpoint of stage {before.name} with another RoPE "
            f"({'; '.join(changes)})")
    if stage.train.stage == "sft":
        raise RecipeError(f"{what}; an SFT keeps the RoPE its checkpoint was trained with: use the SFT recipe of that "
                          "model (recipes/sft_2m.yaml, sft_4m.yaml) or set its rope.* and model.max_position_embeddings")
    print(f"warning: {what}: positions change from those it was trained with", file=sys.stderr)


def check_stage_order(names: list[str], recipes: list[Recipe]) -> None:
    """No stage starts from a checkpoint that only a later stage writes (`--stages sft,cpt_1m` before any CPT: the
    SFT job would find no checkpoint after its queue wait). One that exists already may be started from."""
    for i, recipe in enumerate(recipes):
        init = recipe.checkpoint.init_from
        if init is None or Path(init).exists():
            continue
        for name, later in zip(names[i + 1:], recipes[i + 1:]):
            if later.checkpoint.dir is not None and Path(init).absolute() == Path(later.checkpoint.dir).absolute():
                raise RecipeError(f"stage {names[i]} starts from {init!r}, which stage {name} writes after it: list "
                                  f"{name} before {names[i]} in --stages")
