"""The 2-process half of ``test_elastic_resume``: one gloo spawn runs every case in turn.

Per recipe family: the uninterrupted 2-process run, a 2-process run cut after k steps (resumed
on 1 process by the test), the continuation of the test's 1-process cut (1 -> 2), and an HSDP
(2 x 1) run cut after k then continued as FSDP 2. Plus, for every optimizer kiln ships (8-bit
AdamW's quantised state included): the same training on 2 ranks as on one process, its state
saved through DCP, and the one-process save loaded here (states written out, dequantised, for
the test to compare).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from kiln.checkpointing import storage
from kiln.components import distributed
from tests import forked
from tests.checkpointing.elastic import eager
from tests.parallelisms.tiny import free_port, init_gloo

WORLD = 2
# 8-bit: uneven rows (33 + 32) of 128, 32-element rows (the tiny Nova embedding), uneven 2 + 1
# rows of 4096 (blocks of 256); fp32: a 1-D tensor
SHAPES = [(65, 128), (258, 32), (3, 4096), (64,)]
# Every optimizer kiln ships, with the options that give it state to reshard.
OPTIMIZERS = {
    "adamw": {}, "adamw8bit": {}, "adam_atan2": {"ema": 0.9}, "muon": {},
    "sgd": {"momentum": 0.9}, "sign_sgd": {"momentum": 0.9},
}


class Params(nn.Module):
    def __init__(self, shapes) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=gen) * 0.1)
                                   for s in SHAPES if s in shapes)


def optimizer(name: str, shard: bool):
    """A model of SHAPES (Muon: its matrices) and ``name``'s optimizer over it."""
    from kiln.components.base import default_config

    model = Params([s for s in SHAPES if name != "muon" or len(s) == 2])
    if shard:
        fully_shard(model)
    cfg = default_config("optimizer", name, lr=1e-2, weight_decay=0.1, **OPTIMIZERS[name])
    return model, cfg.build([{"params": list(model.parameters()), "lr": cfg.lr,
                              "peak_lr": cfg.lr}])


def train_steps(model, opt, steps: int, seed: int = 1) -> None:
    """Fixed full-size gradients, so one process and two compute the same update."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) \
                if isinstance(p, DTensor) else g
        opt.step()
        opt.zero_grad(set_to_none=True)


def dump_state(model, opt, path: Path | None) -> None:
    """Every state tensor, dequantised and whole, plus the weights (rank 0 writes)."""
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"{i}.param"] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        for k, t in sorted(opt.state[p].items()):
            if not isinstance(t, torch.Tensor):
                out[f"{i}.{k}"] = torch.tensor(float(t))
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            is8bit = type(local).__name__ == "OptimState8bit"
            value = local.dequantize() if is8bit else local
            if isinstance(t, DTensor):  # torchao cannot pad an uneven 8-bit shard to gather it
                value = DTensor.from_local(value, t.device_mesh, t.placements, run_check=False,
                                           shape=t.shape, stride=t.stride()).full_tensor()
            out[f"{i}.{k}"] = value
            out[f"{i}.{k}.is8bit"] = torch.tensor(is8bit)
    if path is not None:
        save_file({k: v.contiguous() for k, v in out.items()}, str(path))


def save_state(model, opt, folder: Path, no_dist: bool) -> None:
    storage.quiet_dcp()  # DCP warns "single process" even when asked for one (no_dist)
    dcp.save({"o": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(folder),
             no_dist=no_dist)


def load_state(model, opt, folder: Path, no_dist: bool) -> None:
    sd = {"o": get_optimizer_state_dict(model, opt)}
    storage.quiet_dcp()
    dcp.load(sd, checkpoint_id=str(folder), no_dist=no_dist)
    set_optimizer_state_dict(model, opt, sd["o"])


def case_optimizers(tmp: Path, rank: int) -> None:
    """Per optimizer: trained on 2 ranks (dumped, saved), then the 1-process save loaded."""
    for name in OPTIMIZERS:
        model, opt = optimizer(name, shard=True)
        train_steps(model, opt, 2)
        dump_state(model, opt, tmp / f"{name}_two.safetensors" if rank == 0 else None)
        save_state(model, opt, tmp / f"{name}_two", no_dist=False)
        model, opt = optimizer(name, shard=True)
        train_steps(model, opt, 1, seed=7)  # other state, then overwritten by the load
        load_state(model, opt, tmp / f"{name}_one", no_dist=False)
        dump_state(model, opt, tmp / f"{name}_one_on_two.safetensors" if rank == 0 else None)


def case_runs(tmp: Path, rank: int) -> None:
    from tests.checkpointing.elastic import K, train

    for family, r12_extra in (("dense", ["--parallelism.fsdp=off"]),
                              ("looped", []), ("nova", ["--training.micro_batch=1"])):
        base = tmp / family
        outs = {
            "full2": train(family, base / "full2"),
            "cut2": train(family, base / "cut2", stop_after=K),
            "r12": train(family, base / "r12", *r12_extra),
            "hsdp_cut": train(family, base / "hsdp", "--parallelism.dp_replicate=2",
                              stop_after=K),
            "hsdp_fsdp": train(family, base / "hsdp"),
        }
        if rank == 0:
            for name, text in outs.items():
                (base / f"{name}.out").write_text(text)


def _worker(rank: int, port: int, tmp: str) -> None:
    import faulthandler

    faulthandler.enable()
    init_gloo(rank, WORLD, port)
    try:
        with eager():
            case_optimizers(Path(tmp), rank)
            case_runs(Path(tmp), rank)
    finally:
        distributed.shutdown(together=sys.exc_info()[0] is None)


def run(tmp: Path) -> None:
    forked.spawn(_worker, args=(free_port(), str(tmp)), nprocs=WORLD)
