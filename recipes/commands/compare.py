"""`kiln compare RUN... [--sort COLUMN] [--json | --markdown]`: one table of the recipe keys that
differ between runs beside each run's results (final / best loss, final / best eval loss and bits
per byte, a mixture's eval loss per source, each downstream task's headline score, tokens/s,
MFU, wall-clock, steps done)."""

from __future__ import annotations

import json
from typing import Any

from kiln.components.errors import RecipeError
from kiln.recipes.config.diff import ABSENT, differing, short_names
from kiln.recipes.runs.read import Run, open_runs, summary

# Result columns in table order: summary key -> header. A mixture's per-source eval losses
# (``source/<name>``, headed ``<name> eval``), then task columns (``task/<name>``, headed
# ``<name> <metric>``) follow eval_bpb.
RESULTS = {
    "steps": "steps", "final_loss": "final loss", "best_loss": "best loss",
    "eval_loss": "eval loss", "best_eval_loss": "best eval", "eval_bpb": "eval bpb",
    "tokens_per_second": "tok/s", "mfu": "MFU", "wall_clock_s": "wall-clock",
}
ALWAYS = ("steps", "final_loss", "best_loss")  # shown even when no run has them
SPEED = ("tokens_per_second", "mfu", "wall_clock_s")  # the last columns


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", help="run folders (runs/<name>)")
    parser.add_argument("--sort", default="", help="sort rows by this column (a header such as "
                        "'eval loss', or a key such as eval_loss or lr); prefix '-' for descending")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print a JSON list, one object per run")
    fmt.add_argument("--markdown", action="store_true", help="print a Markdown table")


def table(runs: list[Run]) -> tuple[list[str], list[dict[str, Any]]]:
    """(column keys, rows): the differing recipe keys (short names; the ``[evals]`` tables in
    one ``evals`` column), then the results."""
    diffs = differing([r.recipe for r in runs]) if len(runs) > 1 else {}
    evals = {k: v for k, v in diffs.items() if k.startswith("evals.")}
    # a mixture source some runs lack: one "sources" cell, not a column per setting of it
    lone = {k: v for k, v in diffs.items()
            if k.startswith("data.sources.") and any(x is ABSENT for x in v)}
    diffs = {k: v for k, v in diffs.items() if k not in evals and k not in lone}
    taken = set(RESULTS) | set(RESULTS.values()) | {"evals", "sources"}
    short = {k: k if name in taken else name for k, name in short_names(list(diffs)).items()}
    rows = []
    for i, run in enumerate(runs):
        row = {"run": run.label, **{short[k]: values[i] for k, values in diffs.items()}}
        if evals:
            row["evals"] = _evals_cell(evals, i)
        if lone:
            row["sources"] = ", ".join(sorted({k.split(".")[2] for k, v in lone.items()
                                               if v[i] is not ABSENT}))
        row.update(summary(run))
        rows.append(row)
    tasks = sorted({k for r in rows for k in r if k.startswith("source/")})
    tasks += sorted({k for r in rows for k in r if k.startswith("task/")})
    results = [k for k in RESULTS if k in ALWAYS or any(r.get(k) is not None for r in rows)]
    speed = [k for k in results if k in SPEED]
    return ["run", *short.values(), *(["evals"] if evals else []), *(["sources"] if lone else []),
            *[k for k in results if k not in SPEED], *tasks, *speed], rows


def _evals_cell(evals: dict[str, list[Any]], i: int) -> str:
    """What run ``i``'s ``[evals]`` tables hold that the other runs' do not: a task the others
    lack by its name, a setting by ``task.key=value``."""
    tasks: dict[str, list[str]] = {}
    for key, values in evals.items():
        name, setting = key[len("evals."):].split(".", 1)
        if values[i] is ABSENT:
            continue
        tasks.setdefault(name, [])
        if all(v is not ABSENT for v in values):  # the task is in every run: the setting
            tasks[name].append(f"{name}.{setting}={json.dumps(values[i], default=str)}")
    lone = [name for name, settings in tasks.items()
            if any(evals[k][j] is ABSENT for k in evals if k.startswith(f"evals.{name}.")
                   for j in range(len(evals[k])))]
    return ", ".join([*lone, *(s for n, ss in tasks.items() if n not in lone for s in ss)])


def headers(columns: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """Each column's header: a task's is ``<name> <metric>`` (its headline metric)."""
    out = []
    for c in columns:
        if c.startswith("source/"):
            out.append(f"{c[len('source/'):]} eval")
        elif c.startswith("task/"):
            name = c[len("task/"):]
            metrics = sorted({r["task_metrics"][name] for r in rows
                              if name in r.get("task_metrics", {})})
            out.append(f"{name} {'/'.join(metrics)}")
        else:
            out.append(RESULTS.get(c, c))
    return out


def sort_rows(columns: list[str], rows: list[dict[str, Any]], spec: str) -> list[dict[str, Any]]:
    descending = spec.startswith("-")
    name = spec.lstrip("-")
    named = headers(columns, rows)
    by_header = dict(zip(named, columns, strict=True))
    key = by_header.get(name, name)
    if key not in columns:
        raise RecipeError(f"--sort {spec!r}: no such column; columns: {', '.join(named)}")
    present = [r for r in rows if r.get(key) is not None]
    missing = [r for r in rows if r.get(key) is None]
    present.sort(key=lambda r: _sort_key(r[key]), reverse=descending)
    return present + missing  # runs without the figure last either way


def _sort_key(value: Any) -> tuple:
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "mfu":
        return f"{value:.1%}"
    if key == "tokens_per_second":
        return f"{value:,.0f}"
    if key == "wall_clock_s":
        minutes, seconds = divmod(int(round(value)), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"
    if isinstance(value, float):
        return f"{value:.4f}" if _numeric(key) else f"{value:g}"
    text = str(value)
    return text if text.isprintable() else json.dumps(text)[1:-1]  # escaped: one line per row


def _numeric(key: str) -> bool:
    return key in RESULTS or key.startswith(("task/", "source/"))


def render(columns: list[str], rows: list[dict[str, Any]], markdown: bool = False) -> str:
    heads = headers(columns, rows)
    body = [[cell(c, r.get(c)) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(heads)]
    fmt = lambda cells: "  ".join(  # noqa: E731 - text left, numbers right
        c.rjust(w) if _numeric(columns[i]) else c.ljust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
    return "\n".join([fmt(heads), *(fmt(row) for row in body)])


def report(paths: list[str], *, sort: str = "", as_json: bool = False,
           markdown: bool = False) -> str:
    runs = open_runs(paths)
    columns, rows = table(runs)
    if sort:
        rows = sort_rows(columns, rows, sort)
    if as_json:
        return json.dumps([{c: r.get(c) for c in columns} | r for r in rows], indent=2,
                          default=str)
    return render(columns, rows, markdown)


def run(args) -> int:
    if args.overrides:
        raise RecipeError(f"kiln compare takes run folders, not overrides: {args.overrides[0]}")
    print(report(args.runs, sort=args.sort, as_json=args.json, markdown=args.markdown))
    return 0
