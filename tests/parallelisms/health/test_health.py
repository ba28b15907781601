"""The start-up health check: known results of every collective on every group, bus bandwidth, a
matmul per device against a float64 reference; a rank returning wrong results is named by every
rank before any training (2 gloo processes, faults injected into one)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kiln.components.errors import HealthCheckFailed
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.health import check as health
from kiln.parallelisms.health.check import HealthCheckConfig, run_health_check
from tests import forked
from tests.parallelisms.tiny import free_port, rank_env

ONE = SimpleNamespace(rank=0, world_size=1, local_rank=0, distributed=False,
                      device=torch.device("cpu"))
QUICK = HealthCheckConfig(enable="on", size_mb=0.25, iters=1, matmul_size=64)


def test_auto_is_off_for_one_process_and_on_checks_the_device():
    lines = []
    assert run_health_check(HealthCheckConfig(), ParallelismConfig(), ONE, lines.append).lines \
        == [] and lines == []
    report = run_health_check(QUICK, ParallelismConfig(), ONE, lines.append)
    assert report.lines == lines and len(lines) == 1
    assert lines[0].startswith("health check: 64x64 matmul on every device within")
    assert report.mesh is None and report.ep_mesh is None


def test_a_device_computing_wrong_numbers_is_named(monkeypatch):
    monkeypatch.setattr(health, "_device_matmul", lambda a, b: (a @ b) * 1.05)
    with pytest.raises(HealthCheckFailed) as err:
        run_health_check(QUICK, ParallelismConfig(), ONE)
    text = str(err.value)
    assert "rank 0 (host " in text and ", cpu): a 64x64 float32 matmul differs" in text
    assert "this device computes wrong numbers" in text and "before any training" in text


def test_mesh_groups_skip_dimensions_that_repeat_the_world(monkeypatch):
    """A 4-rank (dp_replicate 2, dp_shard 1, tp 2) mesh: both dims are proper sub-groups; a
    dimension of size 1, or spanning all ranks, is no new group."""
    import torch.distributed as dist

    sizes = {"dp_replicate": 2, "dp_shard": 1, "tp": 2}

    class Mesh:
        def __getitem__(self, name):
            return SimpleNamespace(size=lambda: sizes[name])

        def get_group(self, name):
            return f"pg-{name}"

    fake = Mesh()
    monkeypatch.setattr(dist, "get_process_group_ranks",
                        lambda g: [0, 2] if "dp" in g else [0, 1])
    groups = health.mesh_groups(fake, ("dp_replicate", "dp_shard", "tp"), world_size=4)
    assert [(g.name, g.ranks) for g in groups] == [("dp_replicate", [0, 2]), ("tp", [0, 1])]
    assert health.mesh_groups(fake, ("tp",), world_size=2) == []  # spans the world


def test_bus_bandwidth_factors_follow_nccl_tests():
    from kiln.parallelisms.health.collectives import CASES

    share = {c.name: c.bus_share(8) for c in CASES}
    assert share == {"all-reduce": 1.75, "all-gather": 0.875, "reduce-scatter": 0.875,
                     "broadcast": 1.0, "all-to-all": 0.875}


# ------------------------------------------------------------------------ 2 gloo processes
def _worker(rank: int, port: int, out: str) -> None:
    from kiln.components import distributed

    rank_env(rank, 2, port)
    world = distributed.init("cpu")
    results: dict = {}
    real_all_reduce, real_all_to_all = distributed.all_reduce_, distributed.all_to_all_single_

    def off_by_one(t, *args, **kwargs):  # rank 1 receives a wrong sum
        return real_all_reduce(t, *args, **kwargs).add_(1)

    def scrambled(output, *args, **kwargs):  # rank 1's all-to-all delivers its chunks reversed
        real_all_to_all(output, *args, **kwargs)
        return output.copy_(output.flip(0))

    faults = {
        "clean": {},
        "all_reduce": {(distributed, "all_reduce_"): off_by_one},
        "all_to_all": {(distributed, "all_to_all_single_"): scrambled},
        "matmul": {(health, "_device_matmul"): lambda a, b: (a @ b) + 0.5},
    }
    try:
        for name, patches in faults.items():
            saved = {key: getattr(*key) for key in patches}
            if rank == 1:
                for (module, attr), fn in patches.items():
                    setattr(module, attr, fn)
            lines: list[str] = []
            try:
                run_health_check(QUICK, ParallelismConfig(), world, lines.append)
                results[name] = {"ok": lines}
            except HealthCheckFailed as exc:
                results[name] = {"error": str(exc)}
            finally:
                for (module, attr), fn in saved.items():
                    setattr(module, attr, fn)
    finally:
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(results, f)
        distributed.shutdown()


@pytest.mark.slow
def test_two_processes_pass_and_a_wrong_rank_is_named_by_every_rank(tmp_path):
    forked.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    clean = ranks[0]["clean"]["ok"]
    assert clean[0].startswith("health check: 2 processes on 1 host, cpu: all-reduce, "
                               "all-gather, reduce-scatter, broadcast and all-to-all correct on "
                               "every group (world)")
    assert clean[1].startswith("health check: bus bandwidth GB/s on world (0.25 MiB, slowest "
                               "rank): all-reduce ")
    assert "ranks agree bit for bit" in clean[2]
    for fault, says in (("all_reduce", "all-reduce on world (2 ranks) returned wrong values"),
                        ("all_to_all", "all-to-all on world (2 ranks) returned wrong values"),
                        ("matmul", "float32 matmul differs from the float64 reference")):
        errors = [r[fault].get("error", "") for r in ranks]
        assert errors[0] == errors[1], fault  # every rank stops with the same message
        assert "rank 1 (host " in errors[0] and says in errors[0], (fault, errors[0])
        assert "rank 0 (host" not in errors[0], (fault, errors[0])  # only the faulty rank
