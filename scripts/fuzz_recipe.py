"""Set each key of a recipe to wrong values and run ``kiln validate``'s checks on it, in process:
anything but kiln's one-line error (a raw exception) is reported, once per place it came from.

    python scripts/fuzz_recipe.py train_configs/debug.toml [--switch] [--data]
        [--keys optimizer.,model.ffn.] [--base --checkpoint.init_from=DIR] [--accepted FILE]

- every leaf key of the resolved recipe (``kiln show``) gets each of ``VALUES``;
- ``--switch``: also every registered component in each slot of ``SLOTS`` the recipe has, with
  each of that component's keys mutated the same way;
- ``--data``: read the data as ``kiln validate`` does (slower: a changed data key prepares anew);
- ``--accepted FILE``: the mutations validate accepted, as JSON lists of overrides, for a second
  pass that trains each for a step or two (``kiln train RECIPE --training.steps=2 ...``): a
  refusal train gives that validate did not is a bug too (docs/contributing.md).

Exit status 1 when a raw exception was found. Written for this repository (no fuzzing library
knows recipe keys); the values are the bad inputs users write: wrong types, zero, negatives,
out-of-range numbers, empty strings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tomllib
import traceback

from kiln.components import registry
from kiln.components.errors import KilnError
from kiln.components.registry import RegistryError
from kiln.recipes.commands.validate import describe
from kiln.recipes.config.files import load_recipe, to_toml

VALUES = ('"abc"', "-1", "0", "1e30", "true", "[1, 2]", '""', "0.5", "2", "7")
SLOTS = {"model": "model", "model.attention": "attention", "model.ffn": "ffn",
         "model.norm": "norm", "model.attention.position": "position",
         "optimizer": "optimizer", "optimizer.schedule": "schedule", "tokenizer": "tokenizer",
         "training.step": "step", "training.step.loss": "preference_loss",
         "training.step.rollout": "rollout", "data": "dataset", "adapter": "adapter"}


def leaves(table: dict, prefix: str = ""):
    for key, value in table.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


class Fuzz:
    def __init__(self, recipe: str, base: list[str], data: bool, keys: tuple[str, ...]) -> None:
        self.recipe, self.base, self.data, self.keys = recipe, base, data, keys
        self.seen: set[tuple[str, str]] = set()
        self.raw: list[str] = []
        self.accepted: list[list[str]] = []
        self.tried = 0

    def resolved(self, overrides: list[str]) -> dict:
        with contextlib.redirect_stderr(io.StringIO()):  # its notes were printed by attempt
            return tomllib.loads(to_toml(load_recipe(self.recipe, [*self.base, *overrides])))

    def attempt(self, overrides: list[str]) -> bool:
        """True when validate accepts ``overrides``; a raw exception is recorded."""
        self.tried += 1
        try:
            with contextlib.redirect_stderr(io.StringIO()), \
                    contextlib.redirect_stdout(io.StringIO()):
                describe(load_recipe(self.recipe, [*self.base, *overrides]), 1, data=self.data)
        except (KilnError, RegistryError):
            return False
        except Exception as exc:  # what this script looks for: reported, never swallowed
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{os.path.relpath(frame.filename)}:{frame.lineno}"
            if (type(exc).__name__, where) not in self.seen:
                self.seen.add((type(exc).__name__, where))
                self.raw.append(f"{' '.join(overrides)}: {type(exc).__name__}: "
                                f"{str(exc)[:200]} ({where})")
            return False
        self.accepted.append(overrides)
        return True

    def mutate(self, table: dict, prefix: str, fixed: list[str]) -> None:
        for key in leaves(table, prefix):
            if key.endswith(".type") or not key.startswith(self.keys):
                continue
            for value in VALUES:
                self.attempt([*fixed, f"--{key}={value}"])

    def run(self, switch: bool) -> None:
        self.mutate(self.resolved([]), "", [])
        if not switch:
            return
        for slot, kind in SLOTS.items():
            for entry in registry.entries(kind):
                fixed = [f"--{slot}.type={entry.name}"]
                if not self.attempt(fixed):
                    continue
                table = self.resolved(fixed)
                for part in slot.split("."):
                    table = table[part]
                self.mutate(table, slot + ".", fixed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--switch", action="store_true",
                        help="also every registered component in each slot")
    parser.add_argument("--data", action="store_true", help="read the data as validate does")
    parser.add_argument("--keys", default="", help="comma-separated key prefixes to mutate")
    parser.add_argument("--base", action="append", default=[],
                        help="an override every attempt starts from (repeatable)")
    parser.add_argument("--accepted", default="", help="write validate's accepted mutations")
    args = parser.parse_args(argv)
    keys = tuple(k for k in args.keys.split(",") if k) or ("",)
    fuzz = Fuzz(args.recipe, args.base, args.data, keys)
    fuzz.run(args.switch)
    if args.accepted:
        with open(args.accepted, "w") as f:
            json.dump(fuzz.accepted, f, indent=0)
    for line in fuzz.raw:
        print(f"RAW {line}")
    print(f"{fuzz.tried} recipes tried, {len(fuzz.accepted)} accepted, "
          f"{len(fuzz.raw)} raw exception(s)")
    return 1 if fuzz.raw else 0


if __name__ == "__main__":
    sys.exit(main())
