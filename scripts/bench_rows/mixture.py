"""The data loader of a three-source ``mixture`` (``train_configs/mixture_debug.toml``: the
stdlib's code, test suites and docstrings) against one ``packed_documents`` source (its
``code`` source alone, the same settings): the time to hand out one global step's micro-batches
(debug shape: 2 micro-batches of 4 x 257 tokens), after a warm-up that builds any cache entry and
touches every page once. The trainer waits on this; it is the whole cost a mixture adds to it.
The mixture reads up to 16 steps ahead in one gather per source, so both sides time a multiple
of 16 steps (``--steps`` rounded up): the block reads are counted at their average rate.
"""

from __future__ import annotations

import time

from bench_rows.common import REPO

RECIPE = REPO / "train_configs" / "mixture_debug.toml"


def _time(loader, per_step: int, steps: int, warmup: int) -> float:
    for _ in range(warmup * per_step):
        next(loader)
    start = time.perf_counter()
    for _ in range(steps * per_step):
        next(loader)
    return (time.perf_counter() - start) / steps


def _side(p: dict, one_source: bool) -> dict:
    from kiln.recipes.config.files import load_recipe

    recipe = load_recipe(RECIPE, ["--data.stages=[]"])
    tr = recipe.data if not one_source else recipe.data.sources["code"]
    t = recipe.training
    dataset = tr.build(tokenizer=recipe.tokenizer.build(), seq_len=t.seq_len, seed=t.seed)
    dataset.prepare()
    loader = dataset.loader("train", micro_batch=t.micro_batch, global_batch=t.global_batch)
    per_step = t.global_batch // t.micro_batch
    steps = -(-p["steps"] // 16) * 16
    step = _time(iter(loader), per_step, steps, p["warmup"])
    return {"step_us": step * 1e6, "sources": 1 if one_source else len(recipe.data.sources)}


def kiln(p: dict) -> dict:
    return _side(p, one_source=False)


def peer(p: dict) -> dict:
    return _side(p, one_source=True)
