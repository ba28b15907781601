"""``kiln data``: build or check a dataset folder.

    kiln data prepare --input PATH... --out DIR [--tokenizer TOK] [--domain NAME] ...
    kiln data prepare [RECIPE] [--source stdlib|folder] [--out DIR] ...
    kiln data info DIR
    kiln data mix RECIPE [--key=value ...]

With ``--input`` the real-corpus builder runs (``components/data/prepare/prepare.py``: parallel,
resumable, a manifest; packed layout or ``--domain`` shards). Without it the recipe's
``packed_documents`` source is built; without ``--out`` it goes to the cache entry a training
run with the same settings would use, so preparing ahead makes the first step start at once.
Either way the last line is the exact recipe override that trains on the result. ``mix`` is a
dry run of a ``mixture`` recipe: it prepares the sources (as training would) and prints what
each source gives per stage, the epochs that implies and what runs out first; nothing trains.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.components.errors import RecipeError

# The [training] defaults that matter here, for a prepare without a RECIPE (tests pin them to
# TrainingConfig): importing the recipe schema would import torch, and `prepare` stays light.
DEFAULT_TRAINING = {"seq_len": 256, "micro_batch": 4, "global_batch": 8, "seed": 0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize a source into a dataset folder",
                          description="tokenize text into a packed-document dataset folder (or "
                          "balanced_shards shards with --domain); flags override the recipe")
    prep.add_argument("recipe", nargs="?", help="recipe whose [data], [tokenizer] and "
                      "[training] seq_len/seed to use (default: built-in defaults)")
    prep.add_argument("--input", nargs="+", action="extend", metavar="PATH",
                      help="files, folders, globs, saved HF datasets, hf://datasets/owner/name "
                      "or stdlib (.txt .jsonl .jsonl.gz .jsonl.zst .parquet .arrow); needs --out")
    prep.add_argument("--out", help="output folder (default: the data cache entry)")
    prep.add_argument("--tokenizer", help='"byte", or a tokenizer.json / folder / '
                      "hf://owner/repo (default: the recipe's [tokenizer])")
    prep.add_argument("--text-field", default="text", help="JSONL field / column of the text")
    prep.add_argument("--split", default="train", help="split of a saved DatasetDict or Hub "
                      "dataset")
    prep.add_argument("--config", default="", help="config (subset) of a Hub dataset")
    prep.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16),
                      help="tokenizer processes (0 = in this process; default: the CPU count)")
    prep.add_argument("--domain", help="write balanced_shards shards into OUT/DOMAIN instead "
                      "of a packed layout")
    prep.add_argument("--shard-tokens", type=int, default=1 << 24,
                      help="tokens per shard with --domain (whole documents; default 16M)")
    prep.add_argument("--on-invalid-utf8", choices=("skip", "fail"), default="skip",
                      help="skip (and count) documents that are not UTF-8, or stop at the first")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace an OUT built from other inputs or settings")
    prep.add_argument("--no-progress", action="store_true",
                      help="no progress bar (there is none when stderr is not a terminal)")
    prep.add_argument("--source", choices=("stdlib", "folder"),
                      help="without --input: stdlib = this machine's Python stdlib; folder = "
                      "the recipe's data.source_path")
    prep.add_argument("--seq-len", type=int, help="sequence length recorded in metadata")
    prep.add_argument("--max-bytes", type=int, help="cap on source text in UTF-8 bytes")
    prep.add_argument("--seed", type=int, help="seed for the eval split and epoch orders")
    prep.add_argument("--num-epochs", type=int, help="shuffled document orders to write")
    prep.add_argument("--eval-fraction", type=float, help="share of documents held out (with "
                      "--eval-split tail: of the tokens)")
    prep.add_argument("--eval-split", choices=("random", "tail"), default="random",
                      help="random: a seeded random --eval-fraction of the documents; tail: the "
                      "contiguous last --eval-fraction of the text, cut inside a document if it "
                      "falls there (as nanoGPT splits one text)")
    prep.add_argument("--eval-input", nargs="+", action="extend", metavar="PATH", default=[],
                      help="files held out whole as the eval split (read after --input)")
    prep.add_argument("--separator", choices=("bos_eos", "eos", "none"), default="bos_eos",
                      help="bos_eos: [BOS] doc [EOS] (default); eos: doc [EOS], GPT-2's "
                      "end-of-text between documents; none: one continuous stream")
    info = sub.add_parser("info", help="validate a dataset folder and print its metadata")
    info.add_argument("folder", help="a prepared dataset folder")
    mix = sub.add_parser("mix", help="a mixture recipe's sources per stage: tokens, shares, "
                         "epochs, what runs out first (dry run)")
    mix.add_argument("recipe", help="a recipe with data.type = \"mixture\"")


def _recipe(args: argparse.Namespace) -> Any:
    if args.recipe:
        from kiln.recipes.config.files import load_recipe

        return load_recipe(args.recipe, args.overrides)
    if args.overrides:
        raise RecipeError(f"overrides {' '.join(args.overrides)} need a RECIPE argument; "
                          "without one use the flags (kiln data prepare --help)")
    return None


def _tokenizer(args: argparse.Namespace, recipe: Any) -> tuple[Any, list[str]]:
    """(tokenizer, the overrides a recipe needs to use it: none when it is the recipe's).
    Flag tokenizers are built directly (not through the registry, which imports every
    component and torch): `prepare` stays a light process."""
    if args.tokenizer is None and recipe is not None:
        return recipe.tokenizer.build(), []
    if args.tokenizer in (None, "byte"):
        from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer

        return ByteTokenizer(), ["--tokenizer.type=byte"]
    from kiln.components.tokenizers.hf_tokenizer import (
        HuggingFaceTokenizer,
        HuggingFaceTokenizerConfig,
    )

    path = args.tokenizer if args.tokenizer.startswith("hf://") else \
        str(Path(args.tokenizer).expanduser().resolve())
    tok = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(type="huggingface", path=path))
    return tok, ["--tokenizer.type=huggingface", f"--tokenizer.path={path}"]


def _layout_settings(args: argparse.Namespace, recipe: Any) -> dict[str, Any]:
    data = recipe.data if recipe is not None else None
    pick = lambda flag, key, default: flag if flag is not None else getattr(  # noqa: E731
        data, key, default)
    tr = recipe.training.model_dump() if recipe is not None else DEFAULT_TRAINING
    return {"seq_len": args.seq_len or tr["seq_len"],
            "seed": args.seed if args.seed is not None else tr["seed"],
            "num_epochs": pick(args.num_epochs, "num_epochs", 4),
            "eval_fraction": pick(args.eval_fraction, "eval_fraction", 0.02)}


def _hint(args: argparse.Namespace, overrides: list[str]) -> str:
    """The command that trains on what was built: the recipe (and overrides) it was prepared
    with, or the default recipe, plus ``overrides`` (which replace a given override of the same
    key: ``--data.path`` once)."""
    def key(arg: str) -> str:
        return arg.removeprefix("--").split("=", 1)[0]

    replaced = {key(w) for w in overrides}
    given = [o for o in args.overrides if key(o) not in replaced]
    words = ["./run_train.sh", args.recipe or "train_configs/debug.toml", *given, *overrides]
    return "train on it: " + " ".join(shlex.quote(str(w)) for w in words)


def _prepare_inputs(args: argparse.Namespace) -> int:
    from kiln.components.data.prepare.prepare import PrepareOptions, prepare

    if not args.out:
        raise RecipeError("--input needs --out: the folder to write the dataset into")
    if args.workers < 0 or args.shard_tokens < 1 or (args.max_bytes or 0) < 0:
        raise RecipeError("--workers must be >= 0, --shard-tokens and --max-bytes >= 1")
    recipe = _recipe(args)
    tokenizer, tok_overrides = _tokenizer(args, recipe)
    out = str(Path(args.out).expanduser().resolve())
    opts = PrepareOptions(
        inputs=args.input, out=out, text_field=args.text_field, split=args.split,
        config=args.config, on_invalid_utf8=args.on_invalid_utf8, max_bytes=args.max_bytes or 0,
        workers=args.workers, domain=args.domain or "", shard_tokens=args.shard_tokens,
        separator=args.separator, eval_inputs=args.eval_input,
        eval_split="files" if args.eval_input else args.eval_split,
        **_layout_settings(args, recipe))
    t0 = time.perf_counter()
    # The bar only on a terminal: in a log file its redraws would be carriage-return frames.
    bar = not args.no_progress and sys.stderr.isatty()
    result = prepare(opts, tokenizer, overwrite=args.overwrite, progress=bar)
    took = time.perf_counter() - t0
    totals, skipped = result.manifest["totals"], result.manifest["skipped"]
    verb = "reused (up to date):" if result.status == "up to date" else \
        f"{result.status} in {took:.1f} s:"
    rate = f", {totals['bytes'] / max(took, 1e-9) / 1e6:.1f} MB/s" if result.status != \
        "up to date" else ""
    print(f"{verb} {result.folder}\n  {totals['docs']:,} documents, {totals['tokens']:,} tokens,"
          f" {totals['bytes']:,} bytes of text ({totals['tokens'] / max(totals['bytes'], 1):.3f}"
          f" tokens/byte{rate})\n  tokenizer {result.manifest['tokenizer']['source']}"
          f"\n  skipped: {skipped['invalid_utf8']} documents with invalid UTF-8, "
          f"{skipped['empty']} empty files")
    if not args.domain:
        meta = json.loads((Path(out) / "metadata.json").read_text())
        _warn_small_splits(meta, recipe, opts.seq_len, prepared=True)
    if args.domain:
        root = Path(out)
        domains = sorted(p.name for p in root.iterdir() if (p / "shards.json").is_file())
        data = ["--data.type=balanced_shards", f"--data.path={root}",
                f"--data.domains={json.dumps(domains)}"]
    else:
        data = ["--data.type=packed_documents", f"--data.path={out}"]
    print(_hint(args, data + tok_overrides))
    return 0


def _components(args: argparse.Namespace) -> tuple[Any, Any, Any, int, int]:
    """(recipe or None, data config, tokenizer, seq_len, seed) from the recipe (if any) and
    the flags."""
    from kiln.components.base import default_config

    recipe = _recipe(args)
    if recipe is not None:
        data, seq_len, seed = recipe.data, recipe.training.seq_len, recipe.training.seed
    else:
        data = default_config("dataset", "packed_documents")
        seq_len, seed = DEFAULT_TRAINING["seq_len"], DEFAULT_TRAINING["seed"]
    flags = {"source": args.source, "path": args.out, "max_bytes": args.max_bytes,
             "num_epochs": args.num_epochs, "eval_fraction": args.eval_fraction}
    updates = {k: v for k, v in flags.items() if v is not None}
    if updates:
        try:
            data = type(data).model_validate({**data.model_dump(), **updates})
        except ValidationError as exc:
            raise RecipeError(f"invalid data option: {exc.errors()[0]['msg']} "
                              f"({', '.join(f'{k}={v!r}' for k, v in updates.items())})") from None
    if data.type == "chat":
        raise RecipeError("chat data is rendered, masked and packed by the run itself on first "
                          "use, and cached (docs/finetuning.md); train the recipe")
    if not hasattr(data, "source"):
        raise RecipeError(f"data type {data.type!r} has no source to prepare; use --input "
                          "(and --domain for balanced_shards)")
    seed = args.seed if args.seed is not None else seed
    return recipe, data, _tokenizer(args, recipe), args.seq_len or seq_len, seed


def _warn_small_splits(meta: dict[str, Any], recipe: Any, seq_len: int, *,
                       prepared: bool) -> None:
    """Warn (stderr) when a split cannot fill one batch of the recipe's batch plan (or the
    default one) on one process: training, or evaluation, would stop at start-up."""
    from kiln.components.data.layout_fit import too_small

    tr = recipe.training.model_dump() if recipe is not None else DEFAULT_TRAINING
    plan = "the recipe's" if recipe is not None else "the default"
    for split, rows, stops in (("train", tr["global_batch"], "training cannot start"),
                               ("eval", tr["micro_batch"], "evaluation stops a run at start-up")):
        problem = too_small(meta, split, seq_len=seq_len, global_batch=rows, world_size=1,
                            prepared=prepared)
        if problem:
            print(f"kiln data: warning: {problem} ({stops}; with {plan} batch plan on one "
                  "process)", file=sys.stderr)


def _summary(folder: Any, meta: dict[str, Any], seq_len: int) -> str:
    train, held = meta["splits"]["train"], meta["splits"]["eval"]
    return (
        f"{folder}\n"
        f"  {meta['total_tokens']:,} tokens in {meta['num_docs']:,} documents "
        f"(tokenizer {meta.get('tokenizer_source', '')} {meta['tokenizer']})\n"
        f"  train: {train['docs']:,} documents, {train['tokens']:,} tokens "
        f"({(train['tokens'] - 1) // seq_len:,} windows of {seq_len} per data epoch, "
        f"{meta['num_epochs']} orders written)\n"
        f"  eval:  {held['docs']:,} documents, {held['tokens']:,} tokens\n"
        f"  source: {meta['source']}"
    )


def _info(folder: str) -> int:
    path = Path(folder)
    from kiln.components.data.prepare.packed_layout import DAMAGED, check_ids, open_layout
    from kiln.components.data.shard_source import read_shards_json

    if (path / "shards.json").is_file():
        meta = read_shards_json(path)
        largest = _check_shard_ids(path, int(meta["vocab_size"]))
        print(f"balanced_shards domain {path.name}: {meta['shards']} shards, "
              f"{meta['total_tokens']:,} tokens in {meta['num_docs']:,} documents "
              f"({meta['token_dtype']}, tokenizer {meta['tokenizer_source']} "
              f"{meta['tokenizer']})\n  token ids: largest {largest}, inside the vocabulary "
              f"of {meta['vocab_size']} (every token read)")
        return 0

    if not (path / "metadata.json").exists() and path.is_dir():
        domains = sorted(p.name for p in path.iterdir() if (p / "shards.json").is_file())
        if domains:
            for d in domains:
                _info(str(path / d))
            return 0
    layout = open_layout(path)
    vocab = int(layout.meta["vocab_size"])
    largest = check_ids(layout.folder, layout.tokens, vocab, DAMAGED)
    print("valid packed-document layout v1:", _summary(layout.folder, layout.meta,
                                                        int(layout.meta["seq_len"])))
    print(f"  token ids: largest {largest}, inside the vocabulary of {vocab} (every token read)")
    return 0


def _check_shard_ids(domain: Path, vocab: int) -> int:
    """Read every token of a domain's shards; the largest id (an id outside the vocabulary
    that shards.json records is a DataError naming the shard)."""
    import numpy as np

    from kiln.components.data.prepare.packed_layout import scan_ids
    from kiln.components.errors import DataError

    largest = -1
    for shard in sorted(domain.glob("shard_*.npy")):
        tokens = np.load(shard, mmap_mode="r", allow_pickle=False)
        top, bad = scan_ids(tokens.reshape(-1), vocab)
        if bad is not None:
            raise DataError(f"{shard}: token id {int(tokens.reshape(-1)[bad])} (token {bad:,}) "
                            f"is outside the vocabulary of {vocab} ids that shards.json records; "
                            "the shard is damaged or was written with another tokenizer: delete "
                            "the domain folder and rerun `kiln data prepare --domain`")
        largest = max(largest, top)
    return largest


def run(args: argparse.Namespace) -> int:
    if args.action == "info":
        return _info(args.folder)
    if args.action == "mix":
        return _mix(args)
    try:
        return _prepare_inputs(args) if args.input else _prepare_source(args)
    except KeyboardInterrupt:  # Ctrl-C: the workers ignore it, the partial build is kept
        sys.stdout.flush()
        what = ("rerun the same command to continue" if args.input else
                "nothing was kept; rerun the same command to build it")
        print(f"kiln data prepare: interrupted; {what}", file=sys.stderr)
        return 130


def _prepare_source(args: argparse.Namespace) -> int:
    recipe, data, (tokenizer, tok_overrides), seq_len, seed = _components(args)
    dataset = data.build(tokenizer=tokenizer, seq_len=seq_len, seed=seed)
    existed = dataset.folder.exists()
    t0 = time.perf_counter()
    folder = dataset.prepare(create=True)
    took = time.perf_counter() - t0
    verb = "reused" if existed else f"built in {took:.1f} s:"
    print(f"{verb} {_summary(folder, dataset.meta, seq_len)}")
    _warn_small_splits(dataset.meta, recipe, seq_len, prepared=bool(args.out))
    print(_hint(args, [f"--data.path={folder}", *tok_overrides]))
    return 0



def _mix(args: argparse.Namespace) -> int:
    """The run plan of a mixture recipe (``Mixture.plan``) as a table, one process assumed
    (the plan is the same on any number: it counts global sequences)."""
    from kiln.recipes.preflight import batch_plan

    recipe = _recipe(args)
    if recipe.data.type != "mixture":
        raise RecipeError(f"{args.recipe}: data.type = {recipe.data.type!r}; `kiln data mix` "
                          "reads a recipe with data.type = \"mixture\" (docs/data.md)")
    tr = recipe.training
    dataset = recipe.data.build(tokenizer=recipe.tokenizer.build(), seq_len=tr.seq_len,
                                seed=tr.seed)
    dataset.prepare()
    steps = batch_plan.total_steps(tr, batch_plan.plan(tr, 1), None)
    for line in dataset.check_run(steps, tr.global_batch):
        print(line)
    lines = dataset.plan(steps, tr.global_batch)
    print(f"mixture: {len(dataset.source_names)} sources, {len(dataset.stages)} stage(s); "
          f"{steps} steps x {tr.global_batch} sequences of {tr.seq_len} tokens")
    print(f"{'stage':<6} {'steps':<12} {'source':<16} {'share':>7} {'sequences':>11} "
          f"{'tokens':>13} {'epochs to here':>15}")
    for p in lines:
        stage = "run" if p["stage"] is None else str(p["stage"])
        span = f"{p['steps'][0]}-{p['steps'][1]}"
        print(f"{stage:<6} {span:<12} {p['source']:<16} {p['share']:>7.1%} "
              f"{p['sequences']:>11,} {p['tokens']:>13,} {p['epochs']:>15.2f}")
    whole = [p for p in lines if p["stage"] is None]
    first = max(whole, key=lambda p: p["epochs"])
    cap = dataset.cfg.max_epochs.get(first["source"])
    limit = f" (max_epochs {cap:g})" if cap is not None else ""
    held = f"its train split holds {dataset.windows(first['source'], 'train'):,} sequences"
    if first["epochs"] < 1:
        print(f"no source repeats: the most read, {first['source']}, gives "
              f"{first['epochs']:.0%} of its train split by step {steps}{limit}; {held}")
    else:
        print(f"runs out first: {first['source']}, read {first['epochs']:.2f} times by step "
              f"{steps}{limit}; {held}")
    return 0
