"""The layout record of a run (``Trainer.layout``): saved with every checkpoint, so a resume on
another layout can report the change and map per-row state by the global-batch ``rows``."""

from __future__ import annotations


def run_layout(trainer) -> dict:
    """World size, mesh sizes (data-parallel dims always, pipeline / context / tensor / expert
    ones when used), FSDP, the batch plan and this rank's rows of each global batch."""
    mesh = trainer.parallel.mesh
    names = (mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)]) if mesh else []
    per_rank = trainer.plan.global_batch // trainer.data_ranks
    ep = trainer.mesh_layout.ep
    return {
        "world_size": trainer.world.world_size,
        "mesh": {**{name: mesh.size(i) for i, name in enumerate(names)
                    if name not in ("pp", "cp", "tp") or mesh.size(i) > 1},
                 **({"ep": ep} if ep > 1 else {})},
        "fsdp": trainer.parallel.fsdp,
        "global_batch": trainer.plan.global_batch,
        "micro_batch": trainer.plan.micro_batch,
        "grad_accum": trainer.plan.grad_accum,
        "rows": [trainer.data_rank * per_rank, (trainer.data_rank + 1) * per_rank],
    }
