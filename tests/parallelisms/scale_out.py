"""Scale-out cases (tensor / expert parallel) trained in gloo processes against one process.

A case is a model kind, a ``[parallelism]`` table and an optimizer setup. ``worker`` trains
each case on the process group's ranks (one spawn runs many cases one after another) and writes
the results as JSON; ``reference`` trains the same model on the whole global batch in the test
process itself (no process group). The models and data are tiny: the point is equality.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kiln.components import distributed, registry
from kiln.components.base import default_config
from kiln.parallelisms import ParallelismConfig, materialize, parallelize
from kiln.parallelisms.layout.mesh import layout
from kiln.recipes.preflight.layout_plan import dry_parallelize, fake_world, local_bytes
from tests.parallelisms.tiny import SEQ, VOCAB, batches, init_gloo, tiny_model

STEPS, GLOBAL_BATCH, SEED, CLIP = 4, 4, 7, 0.5


def _looped_moe(meta: bool):
    cfg = registry.get("model", "looped").config(
        type="looped", dim=64, n_prelude=1, n_recurrent=1, n_coda=1, loops=2, vocab_size=VOCAB,
        injection="adapter", state_norm=True, loop_scale="learned", loop_scale_init=0.5,
        loop_scale_max=1.0,
        attention=default_config("attention", "causal", n_heads=4),
        ffn=default_config("ffn", "moe", n_experts=4, top_k=2, hidden_dim=32, score="sigmoid",
                           n_shared_experts=1, bias_update_coeff=0.01),
    )
    if meta:
        with torch.device("meta"):
            return cfg.build(vocab_size=VOCAB, seq_len=SEQ)
    torch.manual_seed(SEED)
    return cfg.build(vocab_size=VOCAB, seq_len=SEQ)


MODELS = {
    "dense": lambda meta: tiny_model(seed=SEED, meta=meta),
    # differential attention, fused kv-grouped QKV, GQA, QK-norm, per-head lambda and gate,
    # LayerScale, tied embedding/head: every parameter kind tensor parallel leaves whole; and
    # Qwen3-Next's output gate (wg), split by heads as the queries
    "differential": lambda meta: tiny_model(
        seed=SEED, meta=meta, tie_embeddings=True, layerscale_init=0.1,
        attention=default_config("attention", "differential", n_heads=4, n_kv_heads=2,
                                 fused_qkv=True, qk_norm=True, head_gate=True,
                                 output_gate=True, lambda_mode="per_head",
                                 lambda_init_schedule="constant")),
    "looped_moe": _looped_moe,
}

OPTIMIZERS = {
    "adamw": {"main": default_config("optimizer", "adamw", lr=1e-2, weight_decay=0.1)},
    # Muon for the block matrices, AdamW for embeddings, head, norms and the rest
    "muon": {
        "muon": default_config("optimizer", "muon", lr=2e-2, weight_decay=0.1, expert_stacks=True,
                               params={"ndim": [2, 3], "exclude": ["output.*"],
                                       "exclude_modules": ["Embedding"]}),
        "rest": default_config("optimizer", "adamw", lr=1e-2, params={"rest": True}),
    },
}


def train(model, plan, optimizer: str, rank: int, dp_rank: int, dp: int,
          accum: int) -> dict[str, list[float]]:
    from kiln.recipes.training.optimizer_set import OptimizerSet

    opts = OptimizerSet(model, OPTIMIZERS[optimizer], STEPS)
    losses, norms = [], []
    for seqs in batches(SEED, STEPS, GLOBAL_BATCH):
        micro = seqs.chunk(dp)[dp_rank].chunk(accum)
        opts.zero_grad()
        total = torch.zeros(())
        for i, mb in enumerate(micro):
            with plan.grad_sync(i == len(micro) - 1):
                logits = model(mb[:, :-1])
                loss = plan.loss(F.cross_entropy, logits.flatten(0, 1).float(),
                                 mb[:, 1:].flatten()) / len(micro)
                loss.backward()
            total += loss.detach()
        plan.sync_grads()
        norms.append(float(plan.clip_grads(CLIP)))
        opts.step()
        plan.after_optimizer_step()
        if hasattr(model, "on_optimizer_step"):
            model.on_optimizer_step(False)  # MoE bias balancing from all ranks' token counts
        if dist.is_initialized() and dist.get_world_size() > 1:
            distributed.all_reduce_(total)
            total /= dist.get_world_size()  # tensor-parallel peers hold the same loss
        losses.append(float(total))
    out = {"loss": losses, "norm": norms}
    metrics = getattr(model, "metrics", None)
    if metrics is not None and any(k.startswith("moe/") for k in metrics()):
        out["max_load"] = metrics()["moe/max_load"]
    return out


def run_case(case: dict, rank: int, world_size: int) -> dict:
    cfg = ParallelismConfig(**case.get("parallelism", {}))
    world = SimpleNamespace(world_size=world_size, device=torch.device("cpu"), rank=rank)
    shape = layout(cfg, world_size)
    model = MODELS[case["model"]](True)
    plan = parallelize(model, cfg, world)
    materialize(model, "cpu", SEED, mode="replica")
    result = train(model, plan, case.get("optimizer", "adamw"), rank, shape.dp_rank(rank),
                   shape.dp, case.get("accum", 1))
    result["summary"] = plan.summary
    result["param_bytes"] = local_bytes(model.parameters())  # what the layout planner predicts
    return result


def planned_param_bytes(case: dict, world_size: int) -> int:
    """Rank 0's parameter bytes as ``kiln validate --world-size`` plans them (fake ranks)."""
    with fake_world(world_size):
        model = MODELS[case["model"]](True)
        dry_parallelize(model, ParallelismConfig(**case.get("parallelism", {})), world_size)
        return local_bytes(model.parameters())


def reference(case: dict) -> dict:
    """The case in this process, without a process group: one rank, the whole batch."""
    assert not dist.is_initialized()
    one = SimpleNamespace(world_size=1, device=torch.device("cpu"), rank=0)
    model = MODELS[case["model"]](False)
    plan = parallelize(model, ParallelismConfig(), one)
    return train(model, plan, case.get("optimizer", "adamw"), 0, 0, 1, 1)


def worker(rank: int, world_size: int, port: int, cases: dict, out: str) -> None:
    init_gloo(rank, world_size, port)
    results: dict = {}
    try:
        for name, case in cases.items():
            if case.get("check") == "muon_step":
                results[name] = muon_step_difference(case, rank, world_size)
            else:
                results[name] = run_case(case, rank, world_size)
    finally:
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(results, f)
        distributed.shutdown(together=sys.exc_info()[0] is None)


def muon_step_difference(case: dict, rank: int, world_size: int) -> float:
    """One Muon (+ AdamW) step from the same weights and the same gradients, distributed and in
    one process: the largest difference of any parameter afterwards (0 when the distributed
    orthogonalisation sees exactly the full matrices). Multi-step runs drift apart by rounding
    (bf16 Newton-Schulz amplifies gradient sums taken in another order); this checks the layout
    handling on its own."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from kiln.parallelisms.blocks import clean_name
    from kiln.recipes.training.optimizer_set import OptimizerSet

    cfg = ParallelismConfig(**case.get("parallelism", {}))
    world = SimpleNamespace(world_size=world_size, device=torch.device("cpu"), rank=rank)
    model = MODELS[case["model"]](True)
    parallelize(model, cfg, world)
    materialize(model, "cpu", SEED, mode="replica")
    ref = MODELS[case["model"]](False)
    ref_params = dict(ref.named_parameters())
    gen = torch.Generator().manual_seed(SEED)
    for name, p in model.named_parameters():
        full = torch.randn(p.shape, generator=gen)
        ref_params[clean_name(name)].grad = full.clone()
        p.grad = (distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                  if isinstance(p, DTensor) else full.clone())
    for m in (model, ref):
        OptimizerSet(m, OPTIMIZERS[case.get("optimizer", "muon")], STEPS).step()
    diff = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        diff = max(diff, float((full.detach() - ref_params[clean_name(name)].detach()).abs().max()))
    return diff
