from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.fsdp import reshard_policy


def test_reshard_policies():
    default = ParallelismConfig()
    assert [reshard_policy(default, i, 3) for i in range(3)] == [True, True, False]
    always = ParallelismConfig(reshard_after_forward="always")
    assert all(reshard_policy(always, i, 3) for i in range(3))
    never = ParallelismConfig(reshard_after_forward="never")
    assert not any(reshard_policy(never, i, 3) for i in range(3))


def test_config_rejects_bad_values():
    with pytest.raises(ValidationError):
        ParallelismConfig(ac_every=0)
    with pytest.raises(ValidationError):
        ParallelismConfig(float8="mxfp8")
    with pytest.raises(ValidationError):
        ParallelismConfig(dp_shard=-2)
