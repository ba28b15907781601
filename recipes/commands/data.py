"""``kiln data``: build or check a packed-document dataset folder.

    kiln data prepare [RECIPE] [--source stdlib|folder] [--input DIR] [--out DIR] ...
    kiln data info DIR

Without ``--out`` the folder goes to the cache entry a training run with the same settings
would use, so preparing ahead of time makes the first training step start at once.
"""

from __future__ import annotations

import argparse
import shlex
import time
from typing import Any

from pydantic import ValidationError

from kiln.components.errors import RecipeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize a source into a dataset folder",
                          description="tokenize a source into a packed-document dataset folder; "
                          "flags override the recipe's [data] table")
    prep.add_argument("recipe", nargs="?", help="recipe whose [data], [tokenizer] and "
                      "[training] seq_len/seed to use (default: built-in defaults)")
    prep.add_argument("--source", choices=("stdlib", "folder"),
                      help="stdlib = this machine's Python stdlib; folder = --input")
    prep.add_argument("--input", help="folder of .txt/.jsonl files (implies --source folder)")
    prep.add_argument("--out", help="output folder (default: the data cache entry)")
    prep.add_argument("--seq-len", type=int, help="sequence length recorded in metadata")
    prep.add_argument("--max-bytes", type=int, help="cap on source text in UTF-8 bytes")
    prep.add_argument("--seed", type=int, help="seed for the eval split and epoch orders")
    prep.add_argument("--num-epochs", type=int, help="shuffled document orders to write")
    prep.add_argument("--eval-fraction", type=float, help="share of documents held out")
    info = sub.add_parser("info", help="validate a dataset folder and print its metadata")
    info.add_argument("folder", help="a prepared dataset folder")


def _components(args: argparse.Namespace) -> tuple[Any, Any, int, int]:
    """(data config, tokenizer, seq_len, seed) from the recipe (if any) and the flags."""
    from kiln.components.base import default_config

    if args.recipe:
        from kiln.recipes.recipe import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        data, tok_cfg = recipe.data, recipe.tokenizer
        seq_len, seed = recipe.training.seq_len, recipe.training.seed
    else:
        if args.overrides:
            raise RecipeError(f"overrides {' '.join(args.overrides)} need a RECIPE argument; "
                              "without one use the flags (kiln data prepare --help)")
        data, tok_cfg = default_config("dataset", "packed_documents"), default_config(
            "tokenizer", "byte")
        seq_len, seed = 256, 0
    flags = {"source": args.source, "source_path": args.input, "path": args.out,
             "max_bytes": args.max_bytes, "num_epochs": args.num_epochs,
             "eval_fraction": args.eval_fraction}
    if args.input and not args.source:
        flags["source"] = "folder"
    updates = {k: v for k, v in flags.items() if v is not None}
    if updates:
        try:
            data = type(data).model_validate({**data.model_dump(), **updates})
        except ValidationError as exc:
            raise RecipeError(f"invalid data option: {exc.errors()[0]['msg']} "
                              f"({', '.join(f'{k}={v!r}' for k, v in updates.items())})") from None
    if not hasattr(data, "path"):
        raise RecipeError(f"data type {data.type!r} has no dataset folder to prepare")
    seed = args.seed if args.seed is not None else seed
    return data, tok_cfg.build(), args.seq_len or seq_len, seed


def _summary(folder: Any, meta: dict[str, Any], seq_len: int) -> str:
    train, held = meta["splits"]["train"], meta["splits"]["eval"]
    return (
        f"{folder}\n"
        f"  {meta['total_tokens']:,} tokens in {meta['num_docs']:,} documents "
        f"(tokenizer {meta['tokenizer']})\n"
        f"  train: {train['docs']:,} documents, {train['tokens']:,} tokens "
        f"({(train['tokens'] - 1) // seq_len:,} windows of {seq_len} per data epoch, "
        f"{meta['num_epochs']} orders written)\n"
        f"  eval:  {held['docs']:,} documents, {held['tokens']:,} tokens\n"
        f"  source: {meta['source']}"
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "info":
        from kiln.components.data.packed_layout import open_layout

        layout = open_layout(args.folder)
        print("valid packed-document layout v1:", _summary(layout.folder, layout.meta,
                                                            int(layout.meta["seq_len"])))
        return 0
    data, tokenizer, seq_len, seed = _components(args)
    dataset = data.build(tokenizer=tokenizer, seq_len=seq_len, seed=seed)
    existed = dataset.folder.exists()
    t0 = time.perf_counter()
    folder = dataset.prepare(create=True)
    took = time.perf_counter() - t0
    verb = "reused" if existed else f"built in {took:.1f} s:"
    print(f"{verb} {_summary(folder, dataset.meta, seq_len)}")
    print(f"train on it: {train_command(args, folder)}")
    return 0


def train_command(args: argparse.Namespace, folder) -> str:
    """The command that trains on ``folder``: the recipe (and overrides) it was prepared with,
    or the default recipe, plus ``--data.path``."""
    recipe = args.recipe or "train_configs/debug.toml"
    words = ["./run_train.sh", recipe, *args.overrides, f"--data.path={folder}"]
    return " ".join(shlex.quote(str(w)) for w in words)
