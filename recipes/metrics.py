"""Where metrics go: the console, a JSONL file and TensorBoard, all under the run folder."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch


class MetricsWriter:
    """Writes one JSON object per logged step to metrics.jsonl and the same scalars to
    TensorBoard. Only the main rank writes."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._tb_dir = run_dir / "tensorboard"
        self._tb_wanted = tensorboard
        self._tb = None

    def _writer(self):
        if self._tb is None and self._tb_wanted:
            # Imported on first use: tensorboard costs ~1 s to import, not worth it before step 1.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._tb_dir))
        return self._tb

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in values.items()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **clean, "time": round(time.time(), 3)}) + "\n")
        tb = self._writer()
        if tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and value is not None:
                    tb.add_scalar(key, value, step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v
