from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.layout.mesh import mesh_shape


@pytest.mark.parametrize(
    ("shard", "rep", "world", "shape"),
    [
        (-1, 1, 8, (1, 1, 8, 1, 1)), (-1, 2, 8, (1, 2, 4, 1, 1)), (4, 2, 8, (1, 2, 4, 1, 1)),
        (1, 2, 2, (1, 2, 1, 1, 1)), (-1, 1, 1, (1, 1, 1, 1, 1)),
    ],
)
def test_shapes(shard, rep, world, shape):
    assert mesh_shape(ParallelismConfig(dp_shard=shard, dp_replicate=rep), world) == shape


def test_product_must_equal_world():
    msg = r"dp_replicate \(2\) x dp_shard \(2\) = 4.*world size is 8"
    with pytest.raises(RecipeError, match=msg):
        mesh_shape(ParallelismConfig(dp_shard=2, dp_replicate=2), 8)


def test_replicate_must_divide_world():
    with pytest.raises(RecipeError, match="does not divide the world size 8"):
        mesh_shape(ParallelismConfig(dp_replicate=3), 8)


def test_zero_shard_rejected():
    with pytest.raises(RecipeError, match="dp_shard = 0"):
        mesh_shape(ParallelismConfig(dp_shard=0), 2)


def test_expert_parallel_borrows_data_parallel_ranks():
    from kiln.parallelisms.layout.mesh import layout

    shape = layout(ParallelismConfig(tp=2, ep=2), 8)
    assert (shape.shape, shape.ep, shape.dp) == ((1, 1, 4, 1, 2), 2, 4)
    assert "experts over ep 2" in shape.describe()
    with pytest.raises(RecipeError, match=r"parallelism.ep = 3 does not divide the "
                                          r"data-parallel size 4"):
        layout(ParallelismConfig(tp=2, ep=3), 8)


def test_context_parallel_sits_between_data_and_tensor_parallel():
    from kiln.parallelisms.layout.mesh import build_mesh, dp_mesh, fsdp_mesh, layout
    from kiln.recipes.preflight.layout_plan import fake_world

    shape = layout(ParallelismConfig(cp=2, tp=2), 8)
    assert shape.shape == (1, 1, 2, 2, 2) and (shape.dp, shape.grad_ranks) == (2, 4)
    assert shape.describe() == "dp_replicate 1 x dp_shard 2 x cp 2 x tp 2 = 8 ranks"
    assert [shape.coordinate(r, "cp") for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [shape.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # cp x tp share
    with fake_world(8):
        mesh = build_mesh(ParallelismConfig(cp=2, tp=2), 8, "cpu")
        assert fsdp_mesh(mesh).mesh_dim_names == ("dp_shard_cp",) and fsdp_mesh(mesh).size() == 4
        assert dp_mesh(mesh).size() == 4 and mesh["cp"].size() == 2
    with pytest.raises(RecipeError, match=r"parallelism.cp = 3 does not divide the world size "
                                          r"8 / tp 2; valid values: \[1, 2, 4\]"):
        layout(ParallelismConfig(cp=3, tp=2), 8)
    with pytest.raises(RecipeError, match=r"dp_shard \(4\) x cp \(2\) = 8, but the world "
                                          r"size is 4"):
        layout(ParallelismConfig(cp=2, dp_shard=4), 4)
