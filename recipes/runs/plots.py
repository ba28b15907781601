"""Drawing runs with matplotlib: metric curves of several runs overlaid (legend: what differs
between their recipes) and, for MoE runs, an expert-load heatmap (layer x expert over steps).

matplotlib is the optional ``plot`` extra (``pip install 'kiln[plot]'``): training and the
other commands never import it; ``kiln plot`` and ``run.plot_interval`` need it.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

from kiln.components.errors import KilnError, RecipeError
from kiln.components.registry import did_you_mean
from kiln.recipes.config.diff import differing, settings_label
from kiln.recipes.runs import lineage, seed_groups
from kiln.recipes.runs.read import EXPERTS_FILE, Run, pick, read_jsonl, series, task_scores

# train/loss, eval/loss/* and data/share: a mixture's per-source curves; reward: an RL run's
# (drawn where logged); each in-loop task's headline score follows (``default_metrics``)
DEFAULT_METRICS = ("loss", "eval/loss", "train/loss", "eval/loss/*", "data/share", "lr",
                   "grad_norm", "reward")
LEGEND_CHARS = 60
PER_SOURCE = ("train/loss", "eval/loss", "eval/bpb", "data/share", "data/tokens")
# Diagnostics panels (RUN/plots/diagnostics.png): title -> (key prefix, key suffix); a line per
# matching key (layer, loop).
DIAGNOSTICS_PANELS = {
    "residual stream RMS per block": ("diag/act/", "/rms"),
    "attention logit max": ("diag/attn/", "/logit_max"),
    "attention entropy (nats)": ("diag/attn/", "/entropy"),
    "gradient norm per layer": ("diag/grad/layer/", "/norm"),
    "update / weight per layer": ("diag/update/layer/", "/ratio"),
    "loop state RMS": ("diag/state/", "/rms"),
    "gradient into loop state": ("diag/state_grad/", "/norm"),
    "router entropy (normalised)": ("diag/router/", "/entropy"),
}


def require_matplotlib(what: str = "kiln plot"):
    """pyplot with the file-only Agg backend; a KilnError naming the extra when missing."""
    try:
        import matplotlib
    except ImportError:
        raise KilnError(f"{what} needs matplotlib, which is not installed: "
                        "pip install 'kiln[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def legend_labels(runs: list[Run]) -> list[str]:
    """Per run, the recipe values that tell it apart (``lr=0.001, steps=60``); its name when
    nothing differs or when two runs would read the same."""
    diffs = differing([r.recipe for r in runs]) if len(runs) > 1 else {}
    labels = [settings_label(diffs, i) or r.label for i, r in enumerate(runs)]
    # runs that differ in many keys: their names (a legend line must fit beside a panel)
    labels = [lab if len(lab) <= LEGEND_CHARS else r.label
              for r, lab in zip(runs, labels, strict=True)]
    return [f"{r.label}: {lab}" if labels.count(lab) > 1 and lab != r.label else lab
            for r, lab in zip(runs, labels, strict=True)]


def default_metrics(runs: list[Run]) -> list[str]:
    """``DEFAULT_METRICS``, then the headline score of every task the runs scored in the
    loop (``eval/<task>/<metric>``: what a fine-tuned or RL run is judged by)."""
    tasks = [f"eval/{name}/{metric}" for run in runs
             for name, (metric, _) in task_scores(run).items()]
    return [*DEFAULT_METRICS, *dict.fromkeys(tasks)]


def resolve_metrics(runs: list[Run], names: list[str] | None) -> list[str]:
    """The metric keys to draw. Names the user gave must each match a key some run logged;
    the default names are drawn where present. A sub-key whose series equal another's of the
    same name in every run (``lr/main/no_decay`` beside ``lr/main`` under one schedule) is not
    drawn twice."""
    wanted = list(names) if names else default_metrics(runs)
    logged = sorted({k for run in runs for k in run.metric_keys()})
    name_of: dict[str, str] = {}  # key -> the name that selected it
    for name in wanted:
        found = sorted({k for run in runs for k in pick(run, [name])})
        if not found and names:
            raise RecipeError(f"--metrics: no run logged {name!r}{did_you_mean(name, logged)}; "
                              + logged_keys(logged))
        name_of.update({k: name for k in found if k not in name_of})
    if not name_of:
        raise RecipeError(f"none of {', '.join(wanted)} was logged; " + logged_keys(logged))
    drawn: list[str] = []
    for key, name in name_of.items():  # only keys of one name repeat each other: not a loss
        if not any(name_of[k] == name and all(series(r, key) == series(r, k) for r in runs)
                   for k in drawn):  # of 0 and a reward of 0
            drawn.append(key)
    return drawn


def group_panels(keys: list[str]) -> list[tuple[str, list[str]]]:
    """(title, keys) per panel: a key alone, except a mixture's per-source keys (``PER_SOURCE``
    prefixes), which share one panel per prefix, a line per source."""
    panels: list[tuple[str, list[str]]] = []
    for key in keys:
        head = next((p for p in PER_SOURCE if key.startswith(p + "/")), None)
        if head is None:
            panels.append((key, [key]))
        elif panels and panels[-1][0] == head:
            panels[-1][1].append(key)
        else:
            panels.append((head, [key]))
    return panels


def logged_keys(logged: list[str]) -> str:
    """The logged keys, short: a prefix shared by several keys once (``diag/... (40 keys)``;
    the prefix selects them all), wrapped."""
    groups: dict[str, list[str]] = {}
    for key in logged:
        groups.setdefault(key.split("/", 1)[0], []).append(key)
    shown = [ks[0] if len(ks) == 1 else f"{head}/... ({len(ks)} keys)"
             for head, ks in groups.items()]
    return "the runs logged:\n" + textwrap.fill(", ".join(shown), width=96,
                                                initial_indent="  ", subsequent_indent="  ")


def plot_series(ax, xs: list[float], ys: list[float], label: str) -> None:
    """One run's line; a lone point (one evaluation) as a marker with its value beside it."""
    if len(xs) == 1:
        ax.plot(xs, ys, label=label, marker="o", markersize=7, linestyle="none")
        ax.annotate(f"{ys[0]:.4g}", (xs[0], ys[0]), textcoords="offset points", xytext=(6, 4),
                    fontsize="small")
    else:
        ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None)


def plot_band(ax, xs: list[float], mean: list[float], low: list[float], high: list[float],
              label: str) -> None:
    """A seed point's mean line with a shaded band from its lowest to its highest run (an
    error bar where there is one x)."""
    if len(xs) == 1:
        ax.errorbar(xs, mean, yerr=[[mean[0] - low[0]], [high[0] - mean[0]]], label=label,
                    marker="o", markersize=7, linestyle="none", capsize=4)
        ax.annotate(f"{mean[0]:.4g}", (xs[0], mean[0]), textcoords="offset points",
                    xytext=(6, 4), fontsize="small")
        return
    (line,) = ax.plot(xs, mean, label=label, marker="." if len(xs) < 30 else None)
    ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)


def point_series(runs: list[Run], members: list[int], key: str, x: str, smooth_n: int = 1,
                 offsets: list[float] | None = None) -> tuple[list[float], ...]:
    """(xs, mean, low, high) of ``key`` over a seed point's runs at the steps all of them
    logged: the mean, lowest and highest value at each; x is the runs' mean x there (tokens
    and steps agree between seeds, the time does not)."""
    per = []
    for i in members:
        steps, ys = series(runs[i], key, "step")
        xs = series(runs[i], key, x)[0] if x != "step" else steps
        off = offsets[i] if offsets else 0.0
        per.append({s: (v + off, y) for s, v, y in zip(steps, xs, smooth(ys, smooth_n),
                                                       strict=True)})
    common = sorted(set.intersection(*(set(p) for p in per))) if per else []
    values = [[p[s][1] for p in per] for s in common]
    return ([sum(p[s][0] for p in per) / len(per) for s in common],
            [sum(v) / len(v) for v in values], [min(v) for v in values],
            [max(v) for v in values])


def smooth(ys: list[float], n: int) -> list[float]:
    """Trailing moving average over ``n`` points (``n`` <= 1: unchanged)."""
    if n <= 1:
        return ys
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= n:
            total -= ys[i - n]
        out.append(total / min(i + 1, n))
    return out


def expert_loads(run: Run) -> tuple[list[int], dict[str, list[list[float]]]]:
    """(steps, {layer: [per-step loads as multiples of the mean]}) from ``experts.jsonl``;
    empty for a run without MoE layers."""
    path = run.folder / EXPERTS_FILE
    if not path.is_file():
        return [], {}
    steps, layers = [], {}
    for rec in read_jsonl(path):
        loads = rec.get("load")
        if not isinstance(loads, dict):
            continue
        steps.append(rec["step"])
        for layer, values in loads.items():
            layers.setdefault(layer, []).append([float(v) * len(values) for v in values])
    return steps, layers


X_LABELS = {"step": "step", "tokens": "tokens seen", "time": "training time (s)"}


def draw(runs: list[Run], out: str | Path, *, metrics: list[str] | None = None,
         x: str = "step", smooth_n: int = 1, experts: bool = True, title: str = "",
         join: bool = False, each_seed: bool = False) -> Path:
    """Write one PNG: a panel per metric (every run a line), then an expert-load heatmap per
    MoE run. A run started from another run's weights is drawn at its true offset
    (``lineage``); ``join`` draws it and its parent as one line. Runs that differ only in
    their seed (``seed_groups.points``) are one line, their mean, in a band from their lowest
    to their highest value, unless ``each_seed`` (or ``join``). Atomic: the file is whole or
    absent."""
    plt = require_matplotlib()
    keys = resolve_metrics(runs, metrics)
    labels = legend_labels(runs)
    groups = lineage.lines(runs) if join else [[i] for i in range(len(runs))]
    points = [] if join or each_seed else seed_groups.points([r.recipe for r in runs])
    offsets = [lineage.offset(run, x, runs) for run in runs]
    heat = [(run, *expert_loads(run)) for run in runs] if experts else []
    heat = [h for h in heat if h[1]]
    panels = group_panels(keys)
    cols = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / cols)
    fig = plt.figure(figsize=(6 * cols, 3.2 * rows + 3.4 * len(heat)), layout="constrained")
    grid = fig.add_gridspec(rows + len(heat), cols)
    for i, (head, members) in enumerate(panels):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        for key in members:
            for p in points:
                xs, mean, low, high = point_series(runs, p.members, key, x, smooth_n, offsets)
                if xs:
                    line = f"{p.label} ({len(p.members)} seeds)"
                    if key != head:
                        line = f"{line}: {key[len(head) + 1:]}"
                    plot_band(ax, xs, mean, low, high, line)
            for group in [] if points else groups:
                lab = " → ".join(labels[i] for i in group)
                xs, ys, joins = [], [], []
                for i in group:  # parents first: one line through the model's life
                    rx, ry = series(runs[i], key, x)
                    if rx and xs:
                        joins.append(offsets[i])
                    xs += [v + offsets[i] for v in rx]
                    ys += smooth(ry, smooth_n)
                if xs:
                    line = lab if key == head else key[len(head) + 1:]
                    if key != head and len(runs) > 1:
                        line = f"{lab}: {line}"
                    plot_series(ax, xs, ys, line)
                    for at in joins:  # where a child run takes over
                        ax.axvline(at, color="grey", linestyle=":", linewidth=1)
        if head in PER_SOURCE:
            _mark_stages(ax, runs, offsets, x)
        ax.set_title(head + (" per source" if members != [head] else "")
                     + (f" (smoothed over {smooth_n})" if smooth_n > 1 else ""))
        ax.set_xlabel(X_LABELS[x])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for j, (run, steps, layers) in enumerate(heat):
        _heatmap(fig, fig.add_subplot(grid[rows + j, :]), run, steps, layers)
    if title:
        fig.suptitle(title)
    path = save(fig, out)
    plt.close(fig)
    return path


def _mark_stages(ax, runs: list[Run], offsets: list[float], x: str) -> None:
    """A dashed line where a mixture run entered a later stage (its ``data/stage_start``)."""
    marked = False
    for run, off in zip(runs, offsets, strict=True):
        for step in lineage.stage_switches(run):
            at = step if x == "step" else _x_at(run, step, x)
            ax.axvline(at + off, color="black", linestyle="--", linewidth=0.8, alpha=0.6,
                       label=None if marked else "stage switch")
            marked = True


def _x_at(run: Run, step: int, x: str) -> float:
    """The ``x`` value (tokens, time) at ``step``, from the run's logged training lines."""
    steps, _ = series(run, "loss", "step")
    values, _ = series(run, "loss", x)
    before = [v for s, v in zip(steps, values, strict=True) if s <= step]
    return before[-1] if before else 0.0


def _heatmap(fig, ax, run: Run, steps: list[int], layers: dict[str, list[list[float]]]) -> None:
    """Rows: every expert of every MoE layer; columns: logged steps; colour: load as a multiple
    of the mean (1 = balanced, 0 = dead)."""
    import numpy as np

    names = sorted(layers, key=int)
    blocks = [np.asarray(layers[n]).T for n in names]  # each (E, steps)
    grid = np.concatenate(blocks, axis=0)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma",
                      vmin=0.0, vmax=max(2.0, float(grid.max())), origin="upper",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, grid.shape[0], 0))
    edges = np.cumsum([b.shape[0] for b in blocks])
    for edge in edges[:-1]:
        ax.axhline(edge, color="white", linewidth=1)
    ax.set_yticks([e - b.shape[0] / 2 for e, b in zip(edges, blocks, strict=True)],
                  [f"layer {n}" for n in names])
    ax.set_xlabel("step")
    ax.set_title(f"{run.label}: expert load per layer (x mean load; rows: experts)")
    fig.colorbar(image, ax=ax, label="load / mean load")


def save(fig, out: str | Path) -> Path:
    """Save through a temporary file and a rename: a reader never sees half a PNG."""
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise RecipeError(f"--out {out}: write a .png file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path


def draw_panels(run: Run, out: str | Path, panels: dict[str, tuple[str, str]]) -> Path | None:
    """One panel per (title: key prefix, suffix), a line per matching key of one run; None
    when the run logged none of them."""
    keys = run.metric_keys()
    found = {title: [k for k in keys if k.startswith(pre) and k.endswith(suf)]
             for title, (pre, suf) in panels.items()}
    found = {t: ks for t, ks in found.items() if ks}
    if not found:
        return None
    plt = require_matplotlib()
    cols = 2 if len(found) > 1 else 1
    rows = math.ceil(len(found) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False,
                             layout="constrained")
    for ax, (title, ks) in zip(axes.flat, found.items(), strict=False):
        pre, suf = panels[title]
        for key in ks:
            xs, ys = series(run, key)
            ax.plot(xs, ys, label=key[len(pre):len(key) - len(suf)] or key,
                    marker="." if len(xs) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(ks) <= 12:
            ax.legend(fontsize="x-small", ncols=2)
    for ax in list(axes.flat)[len(found):]:
        ax.set_visible(False)
    fig.suptitle(f"{run.label}: diagnostics")
    path = save(fig, out)
    plt.close(fig)
    return path
