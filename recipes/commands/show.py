"""`kiln show RECIPE [--k=v ...]`: print the resolved recipe (every default filled in) as TOML."""

from __future__ import annotations

from kiln.recipes.config.files import load_recipe, to_toml

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="recipe file, run folder or checkpoint folder")
    parser.add_argument("--params", action="store_true",
                        help="also build the model on the meta device and print parameter counts")


def run(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    print(to_toml(recipe), end="")
    if args.params:
        from kiln.recipes.commands.validate import describe

        print("# " + describe(recipe, data=False).replace("\n", "\n# "))
    return 0
