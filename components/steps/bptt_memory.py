"""Peak activation memory of a looped model's training step as a function of H (loops) and K.

``SavedTensorMeter`` counts the bytes autograd keeps for backward (saved tensors, each storage
once) and records their peak: device independent, so CPU runs measure the same quantity a GPU
would hold. On CUDA ``loop_memory`` also reports ``torch.cuda.max_memory_allocated``.
``kiln bench RECIPE --loops 4,8,16`` prints the table.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F


class SavedTensorMeter:
    """Context manager: live and peak bytes of tensors saved for backward inside it."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage pointer -> number of live saves
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if self._refs.get(key, 0) == 0:
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        handle = _Handle(t)
        weakref.finalize(handle, self._release, key, t.untyped_storage().nbytes())
        return handle

    @staticmethod
    def _unpack(handle: Any) -> torch.Tensor:
        return handle.tensor

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= nbytes

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Handle:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def segment_pass(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                 segment_loops: int) -> list[float]:
    """Forward/backward of one global step in segments (no optimizer): the memory pattern of
    ``segmented_bptt``. Returns the loss of each segment."""
    h = model.loops
    k = segment_loops or h
    state, losses = None, []
    for start in range(0, h, k):
        stop = min(start + k, h)
        with model.loop_window(start, stop, slot=0, state=state) as w:
            logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        losses.append(float(loss.detach()))
        state = w.state_out.detach()
    return losses


def loop_memory(model_cfg, *, vocab_size: int, seq_len: int, batch: int, loops: list[int],
                segment_loops: int, device: str = "cpu", seed: int = 0) -> list[dict[str, Any]]:
    """Build the model at each H in ``loops`` and measure one segmented step at fixed K."""
    rows = []
    for h in loops:
        torch.manual_seed(seed)
        cfg = model_cfg.model_copy(update={"loops": h, "carry": False})
        model = cfg.build(vocab_size=vocab_size, seq_len=seq_len).to(device).train()
        ids = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with SavedTensorMeter() as meter:
            segment_pass(model, ids, ids.roll(-1, 1), segment_loops)
        row = {"loops": h, "segment_loops": segment_loops or h,
               "peak_saved_activation_bytes": meter.peak}
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            row["cuda_peak_above_weights_bytes"] = torch.cuda.max_memory_allocated() - base
        rows.append(row)
        del model
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["loops H  segment K  peak saved activations" + (
        "  CUDA peak (above weights)" if "cuda_peak_above_weights_bytes" in rows[0] else "")]
    for r in rows:
        line = (f"{r['loops']:>7}  {r['segment_loops']:>9}  "
                f"{r['peak_saved_activation_bytes'] / 2**20:>19,.1f} MiB")
        if "cuda_peak_above_weights_bytes" in r:
            line += f"  {r['cuda_peak_above_weights_bytes'] / 2**20:>22,.1f} MiB"
        lines.append(line)
    return "\n".join(lines)
