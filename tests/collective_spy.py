"""Records every torch.distributed collective a process makes: which one, the devices of its
tensors, the device the process group expects, and whether kiln code called it other than
through ``kiln.components.distributed`` (the one place allowed to). Installed in the workers of
the 2-process tests; the parent asserts on what they report."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kiln.components import distributed

REPO = Path(__file__).resolve().parents[1]
SOURCE = tuple(str(REPO / top) + "/" for top in
               ("components", "parallelisms", "checkpointing", "recipes"))
HELPERS = str(REPO / "components" / "distributed.py")
P2P_OPS = ("isend", "irecv")
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


class CollectiveSpy:
    def __init__(self) -> None:
        self.calls = 0
        self.wrong_device: list[str] = []
        self.direct_calls: list[str] = []
        self._saved: dict[str, object] = {}

    def install(self) -> CollectiveSpy:
        for name in COLLECTIVES:
            real = getattr(dist, name)
            self._saved[name] = real
            spy = self._wrap(name, real)
            setattr(dist, name, spy)
            if name in P2P_OPS:  # ``P2POp`` (pipelining's batched transfers) checks its op by
                setattr(c10d, name, spy)  # identity against the module's own isend / irecv
        return self

    def uninstall(self) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)
            if name in P2P_OPS:
                setattr(c10d, name, real)

    def _wrap(self, name: str, real):
        @functools.wraps(real)
        def spy(*args, **kwargs):
            self.calls += 1
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(SOURCE) and caller != HELPERS:
                self.direct_calls.append(f"{name} from {caller}")
            want = distributed.group_device(kwargs.get("group"))
            got = {t.device for t in _tensors([*args, *kwargs.values()])}
            if "device" in kwargs and kwargs["device"] is not None:
                got.add(torch.device(kwargs["device"]))
            wrong = {d for d in got if d != want}
            if wrong:
                self.wrong_device.append(f"{name}: {sorted(map(str, wrong))} (group on {want}) "
                                         f"from {caller}")
            return real(*args, **kwargs)

        return spy

    def report(self) -> dict:
        return {"calls": self.calls, "wrong_device": self.wrong_device,
                "direct_calls": self.direct_calls}


@contextlib.contextmanager
def spied_rank(rank: int, world: int, port: int, folder: str) -> Iterator[dict]:
    """A gloo rank of a 2-process test (``rank_env``) whose collectives the spy watches. Yields
    the dict the rank fills with its results; on the way out, even after an error, writes it
    with the spy's report to ``folder/rank{rank}.json`` and leaves the process group."""
    from tests.parallelisms.tiny import rank_env

    rank_env(rank, world, port)
    spy = CollectiveSpy().install()
    results: dict = {}
    done = False
    try:
        yield results
        done = True
    finally:
        spy.uninstall()
        results["spy"] = spy.report()
        Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
        distributed.shutdown(together=done)
