"""`kiln diff A B`: compare two resolved recipes (recipe files, run folders or checkpoints).
Exit status: 0 equal, 1 different, 2 error."""

from __future__ import annotations

import json

from kiln.recipes.config.diff import diff
from kiln.recipes.config.files import load_recipe


def add_arguments(parser) -> None:
    parser.add_argument("a", help="recipe file, run folder or checkpoint folder")
    parser.add_argument("b", help="recipe file, run folder or checkpoint folder")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument("--all", action="store_true", help="also compare run.name and run.folder")


def run(args) -> int:
    a = load_recipe(args.a, args.overrides)
    b = load_recipe(args.b, args.overrides)
    result = diff(a, b, ignore=() if args.all else ("run.name", "run.folder"))
    if args.json:
        print(json.dumps(result.to_json(), indent=2, default=str))
    else:
        print(result.render(args.a, args.b))
    return 0 if result.equal else 1
