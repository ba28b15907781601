"""`kiln compare RUN... [--sort COLUMN] [--columns A,B] [--width N] [--json | --markdown]`: one
table of the recipe keys that differ between runs beside each run's results (final / best loss,
final / best eval loss and bits per byte, a mixture's eval loss per source, each downstream
task's headline score, tokens/s, MFU, wall-clock, steps done). The eval loss and the tasks carry
their standard errors, and marks say which run is best and which are within noise of it
(``recipes/runs/judge.py``); runs scored on different held-out data are flagged."""

from __future__ import annotations

import json
import shutil
import textwrap
from typing import Any

from kiln.components.errors import RecipeError
from kiln.recipes.config.diff import ABSENT, differing, short_names
from kiln.recipes.runs import judge, seed_groups, significance
from kiln.recipes.runs.read import RECENT, Run, open_runs, summary

# Result columns in table order: summary key -> header. A mixture's per-source eval losses
# (``source/<name>``, headed ``<name> eval``), then task columns (``task/<name>``, headed
# ``<name> <metric>``) follow eval_bpb.
RESULTS = {
    "steps": "steps", "final_loss": "final loss", "best_loss": "best loss",
    "eval_loss": "eval loss", "best_eval_loss": "best eval", "eval_bpb": "eval bpb",
    "reward": f"reward (last {RECENT})",
    "tokens_per_second": "tok/s", "mfu": "MFU", "wall_clock_s": "wall-clock",
}
ALWAYS = ("steps", "final_loss", "best_loss")  # shown even when no run has them
SPEED = ("tokens_per_second", "mfu", "wall_clock_s")  # the last columns


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", help="run folders (runs/<name>)")
    parser.add_argument("--sort", default="", help="sort rows by this column (a header such as "
                        "'eval loss', or a key such as eval_loss or lr); prefix '-' for descending")
    parser.add_argument("--columns", default="", help="show only these columns (headers or "
                        "keys, comma-separated; the run's name always comes first)")
    parser.add_argument("--width", type=int, default=None, metavar="N",
                        help="wrap the table into blocks of at most N characters (default: the "
                        "terminal's width, 120 when there is none; 0: never wrap)")
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


def sort_rows(columns: list[str], rows: list[tuple[int, dict[str, Any]]],
              spec: str) -> list[tuple[int, dict[str, Any]]]:
    """``rows`` (index, row) sorted by a column (``-`` first: descending)."""
    descending = spec.startswith("-")
    name = spec.lstrip("-")
    named = headers(columns, [r for _, r in rows])
    by_header = dict(zip(named, columns, strict=True))
    key = by_header.get(name, name)
    if key not in columns:
        raise RecipeError(f"--sort {spec!r}: no such column; columns: {', '.join(named)}")
    present = [r for r in rows if r[1].get(key) is not None]
    missing = [r for r in rows if r[1].get(key) is None]
    present.sort(key=lambda r: _sort_key(r[1][key]), reverse=descending)
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


def _stderr(row: dict[str, Any], key: str) -> float | None:
    """A judged column's standard error in a run's or a point's row (None where it has none:
    a run's reward, older runs)."""
    if key in seed_groups.INFO_KEYS:
        return row.get(seed_groups.INFO_KEYS[key], {}).get("stderr")
    if key.startswith("task/"):
        return row.get("task_info", {}).get(key[len("task/"):], {}).get("stderr")
    return None


def _with_error(key: str, row: dict[str, Any]) -> str:
    """A judged value as ``2.3456±0.0123`` (its standard error), else the plain cell."""
    value, se = row.get(key), _stderr(row, key)
    text = cell(key, value)
    return f"{text}±{se:.4f}" if value is not None and se is not None else text


def _sample_sizes(columns: list[str], rows: list[dict[str, Any]]) -> dict[str, str]:
    """A task's example count for its header, ``n=30`` (``n=30/20`` when the runs differ)."""
    out = {}
    for c in columns:
        if c.startswith("task/"):
            sizes = sorted({int(n) for r in rows if (n := r.get("task_info", {}).get(
                c[len("task/"):], {}).get("examples")) is not None})
            if sizes:
                out[c] = "n=" + "/".join(map(str, sizes))
    return out


def render(columns: list[str], rows: list[dict[str, Any]], markdown: bool = False, *,
           judged: list[judge.Judgment] = (), width: int = 0, legend: str = "",
           caution: str = "") -> str:
    """The table; ``judged`` columns get their standard errors and marks (``*`` best, ``~``
    within noise of it) and a legend below (``legend``, or the runs' one), then the columns'
    notes and ``caution``; ``width`` > 0 wraps the columns into blocks of at most that many
    characters, each starting with the run's name."""
    marks = {j.column: j for j in judged}
    sizes = _sample_sizes(columns, rows)
    heads = [h + (f" ({sizes[c]})" if c in sizes else "") + ("!" if c in marks and marks[c].note
                                                              else "")
             for c, h in zip(columns, headers(columns, rows), strict=True)]
    body = [[(_with_error(c, r) + marks[c].mark(i)) if c in marks else cell(c, r.get(c))
             for c in columns] for i, r in enumerate(rows)]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
        text = "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    else:
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(heads)]
        text = "\n\n".join(_block(block, heads, body, widths, columns)
                            for block in _blocks(widths, width))
    notes = [j.note for j in judged if j.note] + ([caution] if caution else [])
    if any(m in "".join(r) for r in body for m in "*~"):
        notes.insert(0, legend or (
            "±: standard error (eval loss over its eval batches, a task over its examples). *: "
            f"the column's best run; ~: within noise of it (p >= {significance.ALPHA}: a paired "
            "t-test where both runs scored the same examples, else a z-test on the standard "
            "errors); unmarked: worse beyond noise."))
    if not markdown:  # (the notes wrap like the table)
        notes = [textwrap.fill(n, width=width or 100, subsequent_indent="  ") for n in notes]
    return "\n".join([text, *notes])


def _blocks(widths: list[int], width: int) -> list[list[int]]:
    """Column indices per block: the run column first in each, as many others as fit."""
    if width <= 0 or sum(widths) + 2 * (len(widths) - 1) <= width:
        return [list(range(len(widths)))]
    blocks, current, used = [], [0], widths[0]
    for i in range(1, len(widths)):
        if len(current) > 1 and used + 2 + widths[i] > width:
            blocks.append(current)
            current, used = [0], widths[0]
        current.append(i)
        used += 2 + widths[i]
    return [*blocks, current]


def _block(block: list[int], heads: list[str], body: list[list[str]], widths: list[int],
           columns: list[str]) -> str:
    def fmt(cells: list[str]) -> str:  # text left, numbers right
        return "  ".join(cells[i].rjust(widths[i]) if _numeric(columns[i])
                         else cells[i].ljust(widths[i]) for i in block).rstrip()

    return "\n".join([fmt(heads), *(fmt(row) for row in body)])


def pick_columns(columns: list[str], rows: list[dict[str, Any]], spec: str) -> list[str]:
    """``--columns a,b``: the run's name and the named columns (headers or keys), in order."""
    by_header = dict(zip(headers(columns, rows), columns, strict=True))
    wanted = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        key = by_header.get(name, name)
        if key not in columns:
            raise RecipeError(f"--columns {name!r}: no such column; columns: "
                              f"{', '.join(by_header)}")
        wanted.append(key)
    return ["run", *(c for c in wanted if c != "run")]


def report(paths: list[str], *, sort: str = "", as_json: bool = False,
           markdown: bool = False, width: int = 0, only: str = "") -> str:
    runs = open_runs(paths)
    columns, rows = table(runs)
    judged = judge.judge(runs, rows)
    if only:
        columns = pick_columns(columns, rows, only)
    if sort:
        order = sort_rows(columns, list(enumerate(rows)), sort)
        runs = [runs[i] for i, _ in order]
        rows = [r for _, r in order]
        judged = judge.judge(runs, rows)
    if as_json:
        for i, r in enumerate(rows):
            r["judged"] = _marks(judged, i)
        groups = seed_groups.points([r.recipe for r in runs])
        pointed = seed_groups.point_judgments(judged, rows)
        if groups and pointed:  # each run names its point, with the point's figures and marks
            point_rows = seed_groups.point_rows(groups, rows, pointed)
            by_point = seed_groups.judge_points(groups, rows, pointed)
            for g, (k, point) in zip(groups, enumerate(point_rows), strict=True):
                info = {"label": g.label, "seeds": g.seeds,
                        **{j.column: point.get(j.column) for j in pointed},
                        "stderr": {j.column: _stderr(point, j.column) for j in pointed},
                        "judged": _marks(by_point, k)}
                for i in g.members:
                    rows[i]["point"] = info
        return json.dumps([{c: r.get(c) for c in columns} | r for r in rows], indent=2,
                          default=str)
    width = 0 if markdown else width
    text = render(columns, rows, markdown, judged=judged, width=width)
    for note in judge.unfinished(rows):
        text += "\n" + (note if markdown else textwrap.fill(note, width=width or 100,
                                                             subsequent_indent="  "))
    groups = seed_groups.points([r.recipe for r in runs])
    pointed = seed_groups.point_judgments(judged, rows)
    if not groups or not pointed:
        return text
    return f"{text}\n\n{_points_table(groups, rows, pointed, markdown, width)}"


def _marks(judged: list[judge.Judgment], i: int) -> dict[str, dict[str, Any]]:
    """Row ``i``'s mark in each judged column, with its test against the best (--json)."""
    return {j.column: {"mark": j.mark(i), **({"p": j.verdicts[i].p, "test": j.verdicts[i].how}
                                             if i in j.verdicts else {})}
            for j in judged if not j.note}


POINTS_LEGEND = (
    "±: standard error of the mean over the point's seeds. *: the column's best point; ~: "
    f"within noise of it (p >= {significance.ALPHA}: a t-test over the seeds, paired by seed "
    "where both points ran the same seeds, else Welch's); unmarked: worse beyond noise.")


def _points_table(groups: list[seed_groups.Point], rows: list[dict[str, Any]],
                  judged: list[judge.Judgment], markdown: bool, width: int) -> str:
    """Runs that differ only in their seed, as points: the mean of each judged column over a
    point's seeds (``recipes/runs/seed_groups.py``)."""
    point_rows = seed_groups.point_rows(groups, rows, judged)
    marks = [judge.Judgment(j.column, j.label, j.best, j.verdicts, lower=j.lower)
             for j in seed_groups.judge_points(groups, rows, judged)]  # (notes said above)
    for r in point_rows:
        r["point"] = r.pop("run")
    columns = ["point", "seeds", *(j.column for j in judged)]
    title = "Across seeds (each point: the runs that differ only in training.seed):"
    return f"{title}\n" + render(columns, point_rows, markdown, judged=marks, width=width,
                                 legend=POINTS_LEGEND, caution=seed_groups.few_seeds(groups))


def verdicts(paths: list[str]) -> list[str]:
    """The sweep summary's lines: per judged column, its winner, or that there is none; of the
    points over their seeds where the runs repeat settings with other seeds."""
    runs = open_runs(paths)
    _, rows = table(runs)
    judged = judge.judge(runs, rows)
    groups = seed_groups.points([r.recipe for r in runs])
    if groups:
        labels = [g.label for g in groups]
        return [f"across seeds, {judge.sentence(j, labels, 'point')}" for j in
                seed_groups.judge_points(groups, rows, seed_groups.point_judgments(judged, rows))]
    return [judge.sentence(j, [r["run"] for r in rows]) for j in judged]


def run(args) -> int:
    if args.overrides:
        raise RecipeError(f"kiln compare takes run folders, not overrides: {args.overrides[0]}")
    width = args.width if args.width is not None else shutil.get_terminal_size((120, 24)).columns
    print(report(args.runs, sort=args.sort, as_json=args.json, markdown=args.markdown,
                 width=width, only=args.columns))
    return 0
