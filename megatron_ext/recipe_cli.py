"""`python -m megatron_ext.recipe check FILE...`: validate recipes, print the resolved recipe, list fields."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields

from megatron_ext.recipe import Recipe, RecipeError, load_recipe
from megatron_ext.recipe_schema import type_name


def field_docs(cls: type = Recipe, prefix: str = "") -> dict[str, str]:
    """Dotted field path -> docstring, for help output."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_docs(hints[f.name], path + "."))
        else:
            out[path] = f"{f.metadata['doc']} [{type_name(hints[f.name])}]"
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_ext.recipe check FILE... [--world-size N] [--set KEY=VALUE ...] [--fields]`."""
    import argparse
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m megatron_ext.recipe", description="Validate recipes and print the resolved recipe.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate recipes and print the resolved recipe")
    check.add_argument("files", nargs="*", help="recipe YAML files")
    check.add_argument("--world-size", type=int, default=None, help="processes of the run (default: cluster size)")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, e.g. --set train.steps=10 (repeatable; of a key given twice the "
                            "last applies, as in launch, the trainer and tools/plan.py)")
    check.add_argument("--quiet", action="store_true", help="print only one line per file")
    check.add_argument("--fields", action="store_true", help="list every recipe field with its docstring")
    args = parser.parse_args(argv)
    if args.fields:
        for path, doc in field_docs().items():
            print(f"{path}: {doc}")
        return 0
    if not args.files:
        parser.error("check: give at least one recipe file (or --fields)")
    # An override given positionally, as `train` accepts it: said before any recipe is printed, not after a page
    # of YAML that reads as success
    overrides = [file for file in args.files if "=" in file and not Path(file).exists()]
    if overrides:  # one line for them all, as for every other mistake
        sets = " ".join(f"--set {o}" for o in overrides)
        what = ("not a recipe file but an override" if len(overrides) == 1
                else "not recipe files but overrides")
        print(f"error: {', '.join(overrides)}: {what}, it seems; give overrides with {sets}", file=sys.stderr)
        return 1
    from megatron_ext.train_setup import partial_rotary_warning, positions_warning, selective_recompute_warning

    failed = 0
    for file in args.files:
        try:
            recipe = load_recipe(file, args.overrides, world_size=args.world_size)
        except RecipeError as e:
            print(f"error: {file}: {e}", file=sys.stderr)
            failed += 1
            continue
        if not args.quiet:
            print(f"# {file} (resolved)")
            print(recipe.to_yaml())
        # the recipe's own warnings that `launch --check` and the trainer give (those needing the data stay there)
        for check in (positions_warning, partial_rotary_warning, selective_recompute_warning):
            warning = check(recipe)
            if warning:
                print(f"warning: {file}: {warning}", file=sys.stderr)
        print(f"ok: {file}", file=sys.stderr if not args.quiet else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `recipe check ... | head` ends quietly, as a Unix filter does
    raise SystemExit(main())
