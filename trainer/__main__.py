"""Command line: `python -m trainer --recipe <name|path> [--set section.key=value ...]`.

    .venv/bin/python -m trainer --recipe emoji-local
    .venv/bin/python -m trainer --recipe emoji-local --set training.max_steps=5 --set output.dir=/tmp/emoji
    .venv/bin/python -m trainer --list
    .venv/bin/python -m trainer --recipe path/to/my-recipe.yaml     # a recipe file anywhere (docs/own-data.md)

Parses arguments and the recipe (schema), exits 0 with the earlier result when `output.dir` already
holds a finished run, else validates the run the recipe describes and calls the typed `trainer.train.main`.
A problem the user can fix (bad recipe, bad override, missing data file, a bad row among the first
ones checked before the model loads, full disk) is printed as one clear message without a
traceback, with exit code 2. A SIGTERM during training saves that step's checkpoint and exits 143
(trainer/preemption.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from trainer.preemption import EXIT_CODE as PREEMPTED_EXIT
from trainer.preemption import Preempted
from trainer.recipe import Recipe, RecipeError, list_recipes, parse_recipe, require_valid_run

USER_ERRORS: tuple[type[Exception], ...] = (RecipeError,)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Fine-tune Gemma from a recipe.")
    parser.add_argument("--recipe", help=f"a recipe name ({', '.join(list_recipes())}) or a path to a .yaml file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one recipe value (repeatable), e.g. --set training.max_steps=5",
    )
    parser.add_argument("--list", action="store_true", help="list the bundled recipes and exit")
    args = parser.parse_args(argv)
    if not args.list and not args.recipe:
        parser.error("--recipe is required (or --list)")
    return args


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors with a message meant for the user; the local model's is imported only when needed."""
    from trainer.model_files import LocalModelError

    return (*USER_ERRORS, LocalModelError)


def _build_local_model(recipe: Recipe) -> None:
    """`local:gemma3-270m` is built here, at the entry point, once per machine (each rank of a launch waits on
    the build's lock); the training path only finds it (trainer/model_files.py)."""
    if recipe.model.is_local_package:
        from trainer.local_model import resolve_model_path

        resolve_model_path(recipe.model.name_or_path)


def run(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(list_recipes()))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # A finished run exits before the run checks, which read the data (a re-created Job whose data is gone
        # still finds its marker), and before anything is loaded.
        recipe = parse_recipe(args.recipe, args.overrides)
        from trainer.train import finished_result, main

        result = finished_result(recipe)
        if result is None:
            recipe = require_valid_run(recipe, args.recipe)
            _build_local_model(recipe)
            result = main(recipe)
    except _user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Preempted as exc:
        print(f"preempted: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT
    print(json.dumps(result.summary, indent=2))
    print(f"adapter: {result.adapter_dir}")
    if result.merged_dir:
        print(f"merged model: {result.merged_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
