"""Run folders made by hand for the readers' tests: a resolved recipe and metrics lines, no
training."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.recipes.config.files import load_recipe, write_recipe
from tests.conftest import CONFIGS


def make_run(folder: Path, overrides: tuple[str, ...] = (), *, losses=(3.0, 2.5, 2.0),
             evals=(2.4,), interval: int = 10, extra: dict | None = None,
             experts: dict | None = None) -> Path:
    """A run of debug.toml with ``overrides``: a training line every ``interval`` steps with
    these losses, evaluation lines at the end, optionally ``experts.jsonl`` lines."""
    folder.mkdir(parents=True, exist_ok=True)
    if not any(o.startswith("--training.steps=") for o in overrides):  # a finished run
        overrides = (f"--training.steps={len(losses) * interval}", *overrides)
    recipe = load_recipe(CONFIGS / "debug.toml",
                         [*overrides, f"--run.folder={json.dumps(str(folder))}"])
    write_recipe(recipe, folder / "recipe.toml")
    lines = []
    for i, loss in enumerate(losses, 1):
        lines.append({"step": i * interval, "loss": loss, "tokens_per_second": 1000.0 * i,
                      "tokens_seen": 2048 * i * interval, "interval_s": 2.0, "mfu": 0.1,
                      "grad_norm": 1.0 / i, "lr/main": 1e-3 * i, **(extra or {}),
                      "time": 100.0 + i})
    last = len(losses) * interval
    for j, loss in enumerate(evals):
        lines.append({"step": last - (len(evals) - 1 - j) * interval, "eval/loss": loss,
                      "eval/bpb": loss / 2, "time": 200.0 + j})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if experts is not None:
        (folder / "experts.jsonl").write_text(
            "".join(json.dumps({"step": s, "load": load}) + "\n" for s, load in experts.items()))
    return folder
