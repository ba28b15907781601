"""Tensor-parallel pieces that one process can check (the plans themselves train against one
process in test_scale_out.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kiln.components.errors import KilnError
from kiln.parallelisms.tensor_parallel import _check_float8_backend, loss_parallel_context


def test_float8_tensorwise_all_gather_is_refused_on_gloo_with_what_to_do():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        with pytest.raises(KilnError, match=r'parallelism.float8 = "rowwise"') as err:
            _check_float8_backend(mesh)
        assert "parallelism.tp > 1" in str(err.value) and "gloo" in str(err.value)
    finally:
        dist.destroy_process_group()


def test_loss_parallel_context_is_reentrant():
    from kiln.parallelisms import tensor_parallel

    with loss_parallel_context(True):
        with loss_parallel_context(True):  # the trainer's loss inside grad_sync: no second entry
            assert tensor_parallel._loss_parallel_depth == 2
        assert tensor_parallel._loss_parallel_depth == 1
    assert tensor_parallel._loss_parallel_depth == 0
    with loss_parallel_context(False):
        assert tensor_parallel._loss_parallel_depth == 0
