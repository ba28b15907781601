from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.mesh import mesh_shape


@pytest.mark.parametrize(
    ("shard", "rep", "world", "shape"),
    [
        (-1, 1, 8, (1, 8, 1)), (-1, 2, 8, (2, 4, 1)), (4, 2, 8, (2, 4, 1)),
        (1, 2, 2, (2, 1, 1)), (-1, 1, 1, (1, 1, 1)),
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
    from kiln.parallelisms.mesh import layout

    shape = layout(ParallelismConfig(tp=2, ep=2), 8)
    assert (shape.shape, shape.ep, shape.dp) == ((1, 4, 2), 2, 4)
    assert "experts over ep 2" in shape.describe()
    with pytest.raises(RecipeError, match=r"parallelism.ep = 3 does not divide the "
                                          r"data-parallel size 4"):
        layout(ParallelismConfig(tp=2, ep=3), 8)
