"""Where metrics go: the console, a JSONL file and TensorBoard under the run folder, and
optionally Weights & Biases (``[run.wandb]``; its files also go under the run folder)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import time
from pathlib import Path

import torch

from kiln.components.errors import RecipeError


class MetricsWriter:
    """Writes one JSON object per logged step to metrics.jsonl and the same scalars to
    TensorBoard. Only the main rank writes."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, enabled: bool, wandb=None,
                 run_name: str = "", config: dict | None = None):
        self.enabled = enabled
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._tb_dir = run_dir / "tensorboard"
        self._tb_wanted = tensorboard
        self._tb = None
        self._wb_cfg = wandb if enabled else None
        self._wb_meta = (run_name, config or {})
        self._wb = None
        self._session: dict | None = None  # the marker of a session that began, until logged
        if self._wb_cfg is not None and importlib.util.find_spec("wandb") is None:
            raise RecipeError("run.wandb is set but the wandb package is not installed: "
                              "pip install wandb (or remove [run.wandb])")

    def _wandb(self):
        """The W&B run, started on first use; a resumed kiln run continues its W&B run (the id
        is kept in the run folder)."""
        if self._wb is None and self._wb_cfg is not None:
            import wandb

            c, (name, config) = self._wb_cfg, self._wb_meta
            id_file = self.run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.is_file() else ""
            if not run_id:
                run_id = secrets.token_hex(4)  # W&B ids: [a-z0-9]
                self.run_dir.mkdir(parents=True, exist_ok=True)  # (before the first step)
                id_file.write_text(run_id + "\n")
            try:
                self._wb = wandb.init(
                    project=c.project, entity=c.entity or None, name=c.name or name or None,
                    group=c.group or None, tags=c.tags or None, mode=c.mode,
                    dir=str(self.run_dir), config=config, id=run_id, resume="allow")
            except Exception as exc:  # wandb's errors (no key, no network) have no common base
                raise RecipeError(
                    f"run.wandb: Weights & Biases did not start ({type(exc).__name__}: "
                    f"{str(exc).strip()}); log in (`wandb login` or WANDB_API_KEY), or set "
                    'run.wandb.mode = "offline" (files under the run folder, `wandb sync` '
                    "later), or remove [run.wandb]") from None
        return self._wb

    def _writer(self):
        if self._tb is None and self._tb_wanted:
            # Imported on first use: tensorboard costs ~1 s to import, not worth it before step 1.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._tb_dir))
        return self._tb

    def begin_session(self, step: int, total_steps: int | None = None) -> None:
        """Training (re)starts from ``step``: the next line carries ``session: {"from_step":
        step, "total_steps": N}``, so a reader drops what an earlier session logged after that
        step (``recipes/runs/read.py``) and knows where the run ends (``kiln compare`` notes a
        run that has not got there). Nothing is written to metrics.jsonl until then: a run that
        fails before its first step leaves no line. W&B starts here, before the step rather than
        at its first log line, so that a login it lacks stops the run before any work."""
        self._session = {"from_step": step}
        if total_steps is not None:
            self._session["total_steps"] = total_steps
        self._wandb()

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in values.items()}
        line = {"step": step, **clean, "time": round(time.time(), 3)}
        if self._session is not None:
            line["session"] = self._session
            self._session = None
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        scalars = {k: v for k, v in clean.items() if isinstance(v, (int, float))}
        tb = self._writer()
        if tb is not None:
            for key, value in scalars.items():
                tb.add_scalar(key, value, step)
        wb = self._wandb()
        if wb is not None:
            wb.log(scalars, step=step)

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        """A TensorBoard histogram (TensorBoard only: JSONL holds scalars)."""
        tb = self._writer() if self.enabled else None
        if tb is not None:
            tb.add_histogram(tag, values.detach().float().cpu(), step)

    def flush(self) -> None:
        """Make every line logged so far durable: the checkpoint hook calls it before it
        publishes a snapshot, so a snapshot never holds steps whose metrics could be lost."""
        if self._tb is not None:
            self._tb.flush()
        if self.enabled and self.path.is_file():
            with self.path.open("rb") as f:
                os.fsync(f.fileno())

    def where(self) -> str:
        """The line that ends a run: where its outputs are and how to look at them."""
        line = f"kiln: outputs in {self.run_dir}"
        if self._tb_wanted and self._tb_dir.is_dir():
            line += f" (tensorboard --logdir {self._tb_dir})"
        return line

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wb is not None:
            self._wb.finish()
            self._wb = None


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v
