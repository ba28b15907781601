"""``kiln tokenizer train --input PATH... --vocab-size N --out DIR``: a byte-level BPE trained
with the ``tokenizers`` library on local text (the same inputs ``kiln data prepare`` reads),
deterministic, with BOS / EOS / pad; load it with ``[tokenizer] type = "huggingface"``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kiln.components.errors import RecipeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE on local text",
                           description="train a byte-level BPE tokenizer on local text")
    train.add_argument("--input", nargs="+", action="extend", required=True, metavar="PATH",
                       help="files, folders, globs, saved datasets or stdlib (as kiln data "
                       "prepare --input)")
    train.add_argument("--vocab-size", type=int, required=True,
                       help="entries, specials included (>= 259)")
    train.add_argument("--out", required=True, help="new folder for tokenizer.json")
    train.add_argument("--text-field", default="text", help="JSONL field / column of the text")
    train.add_argument("--split", default="train", help="split of a saved DatasetDict")
    train.add_argument("--max-bytes", type=int, default=0,
                       help="train on at most this much text (whole documents; 0 = all)")
    train.add_argument("--min-frequency", type=int, default=2,
                       help="pairs seen fewer times are not merged")


def run(args: argparse.Namespace) -> int:
    from kiln.components.sources.text_sources import expand_inputs
    from kiln.components.tokenizers.bpe_train import Documents, build_bpe, save_bpe

    if args.max_bytes < 0 or args.min_frequency < 1:
        raise RecipeError("--max-bytes must be >= 0 and --min-frequency >= 1")
    out = Path(args.out).expanduser().resolve()
    files = expand_inputs(args.input, split=args.split)
    t0 = time.perf_counter()
    texts = Documents(files, text_field=args.text_field, max_bytes=args.max_bytes)
    tok = build_bpe(texts, args.vocab_size, min_frequency=args.min_frequency)
    save_bpe(tok, out)
    print(f"trained a byte-level BPE of {tok.get_vocab_size():,} entries on "
          f"{texts.docs:,} documents ({texts.bytes / 1e6:.1f} MB) in "
          f"{time.perf_counter() - t0:.1f} s: {out / 'tokenizer.json'}")
    print(f"use it with: --tokenizer.type=huggingface --tokenizer.path={out}")
    return 0
