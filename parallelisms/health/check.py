"""The start-up health check (``[run.health_check]``): is the hardware fit to train on?

Before the data and the model are built, on every rank:

1. every collective kiln uses (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all;
   ``health_collectives.py``) runs on every process group of the run -- the world, and the
   sub-groups of the training mesh (dp_replicate, dp_shard, tp) and of the expert mesh (ep)
   whose ranks differ from the world's -- with inputs whose results are known and checked, on a
   buffer of ``size_mb`` whose bus bandwidth is measured;
2. a seeded ``matmul_size``-square float32 matmul on the rank's device is compared with a
   float64 reference computed on the CPU and with the other ranks' results: a device computing
   wrong numbers is named;
3. on CUDA, each host's peer-to-peer access matrix is logged (N: copies between those two GPUs
   go through the host).

Every rank's findings are gathered, so every rank raises the same error naming the rank, host
and device of each failure before any training; rank 0 prints the result otherwise. The meshes
built for the check are handed to ``parallelize`` (no second set of communicators).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field

from kiln.components import distributed
from kiln.components.base import Config
from kiln.components.errors import HealthCheckFailed


class HealthCheckConfig(Config):
    """``[run.health_check]``: collectives, bandwidth, devices and links, checked first."""

    enable: Literal["auto", "on", "off"] = Field(
        "auto", description="auto = on with more than one process (one process: the matmul only)"
    )
    size_mb: float = Field(
        8.0, gt=0, description="MiB each timed collective moves per rank (its bus bandwidth is "
        "logged; GPU links reach their peak from about 256)"
    )
    iters: int = Field(2, ge=1, description="timed repetitions of each collective")
    matmul_size: int = Field(512, ge=8, description="side of the square matmul every device runs")
    matmul_tolerance: float = Field(
        1e-2, gt=0, description="largest error of a device's matmul against the float64 "
        "reference, relative to the largest entry"
    )


@dataclass
class HealthReport:
    lines: list[str] = field(default_factory=list)
    mesh: object | None = None  # the (dp_replicate, dp_shard, tp) mesh, when built for the check
    ep_mesh: object | None = None  # the (ep_replicate, ep) mesh, likewise


def _device_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matmul under test (its own function: tests make one rank's wrong)."""
    return a @ b


def matmul_finding(size: int, device: torch.device) -> dict:
    """This device's seeded matmul: its error against a float64 CPU reference and a digest of
    its exact bits (ranks on identical hardware agree bit for bit)."""
    import hashlib

    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    got = _device_matmul(a.to(device), b.to(device)).cpu()
    ref = a.double() @ b.double()
    error = float((got.double() - ref).abs().max() / ref.abs().max())
    digest = hashlib.sha256(got.contiguous().numpy().tobytes()).hexdigest()[:16]
    return {"error": error, "digest": digest}


def p2p_matrix() -> list[str] | None:
    """This host's CUDA peer-to-peer access, one row per GPU (``-`` itself, Y, N)."""
    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()

    def cell(i: int, j: int) -> str:
        return "-" if i == j else "Y" if torch.cuda.can_device_access_peer(i, j) else "N"

    return [f"gpu{i}: " + " ".join(cell(i, j) for j in range(n)) for i in range(n)]


def process_groups(pcfg, world) -> tuple[list, object | None, object | None]:
    """(groups to check, training mesh, expert mesh): the world, plus each mesh dimension whose
    ranks are a proper subset of it (a dimension spanning every rank repeats the world)."""
    from kiln.parallelisms.health.collectives import Group
    from kiln.parallelisms.layout.mesh import MESH_DIMS, layout

    groups = [Group("world", None, list(range(world.world_size)))]
    shape = layout(pcfg, world.world_size)
    mesh = ep_mesh = None
    if any(1 < size < world.world_size for size in shape.shape):
        from kiln.parallelisms.layout.mesh import build_mesh

        mesh = build_mesh(pcfg, world.world_size, world.device.type)
        groups += mesh_groups(mesh, MESH_DIMS, world.world_size)
    if shape.ep > 1:
        from kiln.parallelisms.layout.mesh import expert_mesh

        ep_mesh = expert_mesh(shape, world.device.type)
        groups += mesh_groups(ep_mesh, ("ep_replicate", "ep"), world.world_size)
    return groups, mesh, ep_mesh


def mesh_groups(mesh, names: tuple[str, ...], world_size: int) -> list:
    import torch.distributed as dist

    from kiln.parallelisms.health.collectives import Group

    out = []
    for name in names:
        if 1 < mesh[name].size() < world_size:
            group = mesh.get_group(name)
            out.append(Group(name, group, dist.get_process_group_ranks(group)))
    return out


def run_health_check(cfg: HealthCheckConfig, pcfg, world, log=print) -> HealthReport:
    """Check, report on rank 0 through ``log``, raise ``HealthCheckFailed`` on every rank."""
    report = HealthReport()
    if cfg.enable == "off" or (cfg.enable == "auto" and not world.distributed):
        return report
    import socket

    from kiln.parallelisms.health.collectives import CASES, check

    started = time.perf_counter()
    groups, report.mesh, report.ep_mesh = process_groups(pcfg, world) if world.distributed \
        else ([], None, None)
    failures, bandwidth = [], {}
    size = int(cfg.size_mb * 2**20)
    for g in groups:
        for case in CASES:
            problem, busbw = check(case, g, world.rank, world.device, size, cfg.iters)
            if problem is not None:
                failures.append(problem)
            bandwidth[f"{g.name}/{case.name}"] = busbw
    mine = {"rank": world.rank, "host": socket.gethostname(), "device": str(world.device),
            "failures": failures, "bandwidth": bandwidth,
            "matmul": matmul_finding(cfg.matmul_size, world.device),
            "p2p": p2p_matrix() if world.local_rank == 0 else None}
    everyone = distributed.all_gather_object(mine)
    _raise_failures(everyone, cfg)
    report.lines = _describe(everyone, groups, cfg, time.perf_counter() - started)
    for line in report.lines:
        log(line)
    return report


def _raise_failures(everyone: list[dict], cfg: HealthCheckConfig) -> None:
    problems = []
    for r in everyone:
        where = f"rank {r['rank']} (host {r['host']}, {r['device']})"
        problems += [f"{where}: {text}" for text in r["failures"]]
        if not r["matmul"]["error"] <= cfg.matmul_tolerance:  # NaN fails too
            problems.append(
                f"{where}: a {cfg.matmul_size}x{cfg.matmul_size} float32 matmul differs from "
                f"the float64 reference by {r['matmul']['error']:.2e} of its largest entry "
                f"(tolerance {cfg.matmul_tolerance:g}): this device computes wrong numbers")
    if problems:
        raise HealthCheckFailed(
            "the start-up health check failed, before any training:\n  " + "\n  ".join(problems)
            + "\nDrain or replace the named host or device and rerun (the run resumes from its "
            "last checkpoint); run.health_check.enable = \"off\" skips the check")


def _describe(everyone: list[dict], groups: list, cfg: HealthCheckConfig,
              seconds: float) -> list[str]:
    hosts = sorted({r["host"] for r in everyone})
    kinds = "/".join(sorted({r["device"].split(":")[0] for r in everyone}))
    lines = []
    if groups:
        names = list(dict.fromkeys(g.name for g in groups))
        on = f"1 host, {kinds}" if len(hosts) == 1 else f"{len(hosts)} hosts, {kinds}"
        lines.append(
            f"health check: {len(everyone)} processes on {on}: all-reduce, all-gather, "
            f"reduce-scatter, broadcast and all-to-all correct on every group "
            f"({', '.join(names)}) in {seconds:.1f} s")
        for name in names:  # the slowest rank's figure per group kind and collective
            figures = "  ".join(
                f"{key.split('/')[1]} {min(r['bandwidth'][key] for r in everyone) / 1e9:.2f}"
                for key in everyone[0]["bandwidth"] if key.startswith(name + "/"))
            lines.append(f"health check: bus bandwidth GB/s on {name} ({cfg.size_mb:g} MiB, "
                         f"slowest rank): {figures}")
    errors = [r["matmul"]["error"] for r in everyone]
    same = len({r["matmul"]["digest"] for r in everyone}) == 1
    lines.append(
        f"health check: {cfg.matmul_size}x{cfg.matmul_size} matmul on every device within "
        f"{max(errors):.1e} of the float64 reference"
        + ("" if len(everyone) == 1 else "; ranks agree bit for bit" if same else
           "; ranks differ in the last bits (mixed hardware or libraries?)"))
    for r in everyone:
        if r["p2p"]:
            lines.append(f"health check: peer-to-peer access on {r['host']} (N: through the "
                         "host): " + "; ".join(r["p2p"]))
    return lines
