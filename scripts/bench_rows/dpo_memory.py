"""Peak resident memory of one DPO step with LoRA (rank 8 on q/k/v/o of ``dpo.py``'s model and
batch): the reference as the policy with its adapters switched off (kiln's default with an
adapter: no second copy of the weights) against a frozen copy of the base. Each side runs in a
fresh process, so the peak is its own. A report, not a race."""

from __future__ import annotations

import resource
from pathlib import Path

from bench_rows.common import set_threads
from bench_rows.generate import setup  # noqa: F401


def _side(p: dict, reference: str) -> dict:
    from bench_rows.dpo import kiln_step
    from bench_rows.lora import kiln_model

    set_threads(p["threads"])
    model = kiln_model(Path(p["work"]), lora=True)
    run = kiln_step(model, p, reference=reference)
    run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    params = sum(q.numel() * q.element_size() for q in model.parameters()) / 2**20
    return {"peak_mb": peak, "model_mb": params}


def kiln(p: dict) -> dict:
    return _side(p, "adapters_off")


def peer(p: dict) -> dict:
    return _side(p, "frozen_copy")
