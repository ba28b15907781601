"""One 2-process gloo spawn for the Nova family's distributed checks (results as JSON).

Cases: Muon under FSDP2 (owner layout and torch.optim.Muon) against single-process Muon; Muon
and 8-bit AdamW state through DCP under FSDP2; a tied-embedding differential-attention
transformer under ``parallelize`` against one process; the identical-init check. Every rank
also computes the single-process reference itself, so the comparison needs no extra traffic.
Tests call ``results()``; the spawn runs once per pytest session.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from kiln.components import distributed
from kiln.components.data.prepare.packed_layout import file_lock
from tests import forked
from tests.parallelisms.tiny import free_port, init_gloo

WORLD = 2


class Mats(nn.Module):
    """Matrices that exercise the owner layout: a same-shape bucket of 3 (owners 0, 1, 0),
    uneven row shards (7 rows -> 4 + 3) and a 1-row matrix (rank 1 holds nothing of it)."""

    def __init__(self, one_row: bool = True):
        super().__init__()
        self.inp = nn.Linear(16, 24, bias=False)
        self.mid = nn.ModuleList(nn.Linear(24, 24, bias=False) for _ in range(3))
        self.odd = nn.Linear(24, 7, bias=False)
        self.one = nn.Linear(7, 1, bias=False) if one_row else nn.Identity()

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for m in self.mid:
            x = torch.tanh(m(x))
        return self.one(torch.tanh(self.odd(x)))


def _mats(shard: bool, one_row: bool = True) -> Mats:
    torch.manual_seed(0)
    model = Mats(one_row)
    if shard:
        for m in [model.inp, *model.mid, model.odd, model.one]:
            if any(True for _ in m.parameters()):
                fully_shard(m)
        fully_shard(model)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, opts, steps: int, seed: int = 1, dim: int = 16) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, dim, generator=gen)  # the same batch on every rank
        model(x).square().mean().backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((_full(p) - _full(q)).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _dcp_round_trip(make_model, make_opt, folder: str, train=_train) -> float:
    model = make_model()
    opt = make_opt(model)
    train(model, [opt], 2)
    dcp.save({"m": model.state_dict(), "o": get_optimizer_state_dict(model, opt)},
             checkpoint_id=folder)
    model2 = make_model()
    opt2 = make_opt(model2)
    train(model2, [opt2], 1, seed=5)
    state = {"m": model2.state_dict(), "o": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=folder)
    model2.load_state_dict(state["m"])
    set_optimizer_state_dict(model2, opt2, state["o"])
    train(model, [opt], 1, seed=9)
    train(model2, [opt2], 1, seed=9)
    return _max_diff(model, model2)


def _muon(model, implementation: str = "owner"):
    """kiln's muon, or torch.optim.Muon with the same settings (for the evidence only)."""
    from kiln.components.base import default_config

    kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9)
    if implementation == "torch":
        return torch.optim.Muon(model.parameters(), adjust_lr_fn="match_rms_adamw", **kw)
    # bf16 Newton-Schulz, as torch.optim.Muon: the two implementations compared on equal terms
    cfg = default_config("optimizer", "muon", lr_scaling="match_rms_adamw", ns_dtype="bfloat16",
                         **kw)
    return cfg.build([{"params": list(model.parameters()), "lr": cfg.lr, "peak_lr": cfg.lr}])


def case_muon(tmp: str) -> dict:
    out = {}
    for impl, one_row in (("owner", True), ("torch", False)):
        single = _mats(False, one_row)
        _train(single, [_muon(single)], 3)
        sharded = _mats(True, one_row)
        _train(sharded, [_muon(sharded, impl)], 3)
        out[impl] = _max_diff(sharded, single)
    try:  # torch.optim.Muon on a matrix with fewer rows than ranks (an empty local shard)
        sharded = _mats(True)
        _train(sharded, [_muon(sharded, "torch")], 1)
        torch_one_row = "ok"
    except RuntimeError as exc:
        torch_one_row = str(exc).splitlines()[0][:120]
    return {"owner_vs_single": out["owner"], "torch_fsdp2_vs_single": out["torch"],
            "torch_one_row_matrix": torch_one_row,
            "dcp_round_trip": _dcp_round_trip(lambda: _mats(True), _muon, f"{tmp}/muon"),
            "other_layouts_vs_single": case_muon_layouts()}


def case_muon_layouts() -> float:
    """DTensor layouts besides FSDP2's: replicated, column-sharded (both gathered) and a 3-D
    expert stack sharded over experts (orthogonalised locally), against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kiln.components.base import default_config

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(0)
    layouts = [((16, 8), Replicate()), ((8, 12), Shard(1)), ((4, 6, 10), Shard(0)),
               ((5, 8), Shard(0))]
    start = [torch.randn(shape, generator=gen) for shape, _ in layouts]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in layouts] for _ in range(2)]
    cfg = default_config("optimizer", "muon", lr=0.05, weight_decay=0.1, expert_stacks=True)
    single = [nn.Parameter(w.clone()) for w in start]
    dist_ = [nn.Parameter(distribute_tensor(w.clone(), mesh, [pl]))
             for w, (_, pl) in zip(start, layouts, strict=True)]
    for params in (single, dist_):
        opt = cfg.build([{"params": params, "lr": cfg.lr, "peak_lr": cfg.lr}])
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = (distribute_tensor(g, mesh, p.placements) if isinstance(p, DTensor)
                          else g.clone())
            opt.step()
    return max((a - _full(b)).abs().max().item() for a, b in zip(single, dist_, strict=True))


def _embed(shard: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 64), nn.LayerNorm(64))
    if shard:
        fully_shard(model)
    return model


def _train_embed(model, opts, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, 512, (4, 16), generator=gen)).square().mean().backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)


def case_adamw8bit(tmp: str) -> dict:
    from kiln.components.base import default_config
    from kiln.components.optimizers.memory import optimizer_state_bytes

    cfg = default_config("optimizer", "adamw8bit", lr=1e-2, weight_decay=0.1)

    def make_opt(model):
        return cfg.build([{"params": list(model.parameters()), "lr": cfg.lr, "peak_lr": cfg.lr}])

    diff = _dcp_round_trip(lambda: _embed(True), make_opt, f"{tmp}/adamw8bit", _train_embed)
    model = _embed(True)
    opt = make_opt(model)
    _train_embed(model, [opt], 1)
    state = opt.state[model[0].weight]["exp_avg"]
    return {"dcp_round_trip": diff, "state_bytes_rank": optimizer_state_bytes(opt),
            "state_is_dtensor_of": type(state.to_local()).__name__}


def case_tied_transformer(rank: int) -> dict:
    from kiln.components.base import default_config
    from kiln.components.distributed import World
    from kiln.parallelisms import parallelize
    from kiln.parallelisms.config import ParallelismConfig

    def build():
        cfg = default_config(
            "model", "transformer", dim=64, n_layers=2, tie_embeddings=True, logit_softcap=10.0,
            layerscale_init=0.1,
            attention=default_config("attention", "differential", n_heads=4, n_kv_heads=2,
                                     qk_norm=True, fused_qkv=True, head_gate=True),
        )
        torch.manual_seed(0)
        return cfg.build(vocab_size=96, seq_len=16)

    def run(model):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(3):
            seqs = torch.randint(0, 96, (4, 17), generator=gen)
            mine = seqs[2 * rank:2 * rank + 2] if isinstance(model.output.weight, DTensor) \
                else seqs
            logits = model(mine[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    single = build()
    ref_losses = run(single)
    sharded = build()
    parallelize(sharded, ParallelismConfig(meta_init=False), World(rank, WORLD, 0,
                                                                   torch.device("cpu")))
    tied = sharded.output.weight is sharded.tok_embeddings.weight
    losses = run(sharded)
    return {"tied_after_fsdp2": tied, "is_dtensor": isinstance(sharded.output.weight, DTensor),
            "param_diff": _max_diff(sharded, single), "losses_rank": losses,
            "single_losses": ref_losses}


def case_init_check(rank: int) -> dict:
    from kiln.components.errors import KilnError
    from kiln.parallelisms.health.init_check import check_identical_init

    model = _mats(False)
    ok = check_identical_init(model)
    if rank == 1:
        with torch.no_grad():
            model.mid[1].weight[3, 3] += 1.0
    try:
        check_identical_init(model)
        caught = ""
    except KilnError as exc:
        caught = str(exc)
    torch.manual_seed(rank)  # rank-dependent RNG: caught through the RNG state
    try:
        check_identical_init(_mats_no_seed())
        rng_caught = ""
    except KilnError as exc:
        rng_caught = str(exc)
    return {"ok": ok, "caught": caught, "rng_caught": rng_caught}


def _mats_no_seed() -> Mats:
    torch.manual_seed(0)
    model = Mats()
    torch.manual_seed(dist.get_rank())  # what a rank-seeded init would leave behind
    return model


def _worker(rank: int, port: int, out: str) -> None:
    init_gloo(rank, WORLD, port)
    try:
        tmp = [out if rank == 0 else ""]
        dist.broadcast_object_list(tmp)
        res = {"muon": case_muon(tmp[0]), "adamw8bit": case_adamw8bit(tmp[0]),
               "tied": case_tied_transformer(rank), "init_check": case_init_check(rank)}
        tmp_file = Path(out, f"rank{rank}.json.tmp")  # whole or absent: results() checks it
        tmp_file.write_text(json.dumps(res))
        tmp_file.replace(Path(out, f"rank{rank}.json"))
    finally:
        distributed.shutdown(together=sys.exc_info()[0] is None)


@functools.cache
def results() -> dict:
    """Run the spawn once per test session; rank 0's results, plus ``rank1`` for rank 1's.

    The answers are kept in the session's temp folder (the parent of its ``KILN_CACHE``,
    tests/conftest.py), so under pytest-xdist the first worker to ask runs the spawn and the
    others wait on the lock and read them."""
    out = Path(os.environ["KILN_CACHE"]).parent / "nova_dist"
    with file_lock(out / ".lock"):
        if not all(Path(out, f"rank{r}.json").exists() for r in range(WORLD)):
            forked.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD)
    res = json.loads(Path(out, "rank0.json").read_text())
    res["rank1"] = json.loads(Path(out, "rank1.json").read_text())
    return res
