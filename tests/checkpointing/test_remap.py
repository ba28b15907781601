"""Mapping per-rank state onto another layout: the carry regrouped by global batch row, the
global state taken from the process that trained this rank's first row, the layout report."""

from __future__ import annotations

import pytest
import torch

from kiln.checkpointing import payload, remap, storage
from kiln.components.errors import CheckpointError


def _carry(rows: remap.Rows, dim: int = 3) -> dict[str, torch.Tensor]:
    """Slot tensors whose values name their global row: state[i] = row, age = row, ended."""
    out = {}
    for slot in range(rows.slots):
        r = torch.arange(rows.slot_start(slot), rows.slot_start(slot) + rows.micro_batch)
        out[f"state.{slot}"] = r.float()[:, None, None].expand(-1, 2, dim).contiguous()
        out[f"age.{slot}"] = r.clone()
        out[f"ended.{slot}"] = r % 3 == 0
    return out


def _save(folder, rank: int, rows: remap.Rows, carry=True, guard=None):
    tensors = _carry(rows) if carry else {}
    header = {
        "rank": rank, "world_size": 2, "rng": {},
        "payload": {"version": payload.VERSION, "step": 5,
                    "carry": sorted(tensors) if carry else None,
                    "guard_fields": {"spike": guard or {"ema": 1.5, "aborted": False}}},
        "loader": {"step": 5, "micro": 0},
        "batch": {"rows": [rows.start, rows.stop], "micro_batch": rows.micro_batch},
    }
    path = folder / f"rank_{rank:05d}.safetensors"
    storage.save_rank_file(path, {payload.CARRY_PREFIX + k: v for k, v in tensors.items()},
                           header)
    return path


@pytest.fixture
def two_ranks(tmp_path):
    """Saved by 2 ranks x 2 slots of 2 rows: rows 0-3 and 4-7."""
    return [_save(tmp_path, 0, remap.Rows(0, 4, 2)), _save(tmp_path, 1, remap.Rows(4, 8, 2))]


@pytest.mark.parametrize("target", [remap.Rows(0, 8, 1), remap.Rows(0, 8, 4),
                                    remap.Rows(2, 6, 2), remap.Rows(4, 8, 4)])
def test_carry_is_regrouped_by_global_row(tmp_path, two_ranks, target):
    mapped = remap.map_rank_state(tmp_path, two_ranks, 5, target, {"spike"})
    carry = mapped.payload["carry"]
    assert sorted(carry) == sorted(_carry(target))
    for key, value in _carry(target).items():
        assert torch.equal(carry[key], value), key
    assert mapped.loader == {"step": 5, "micro": 0}
    assert mapped.payload["guard_fields"]["spike"]["ema"] == 1.5
    note = mapped.notes[-1]  # only the files holding our rows are read
    assert "regrouped by global batch row" in note
    assert ("rank_00000" in note) == (target.start < 4)
    assert ("rank_00001" in note) == (target.stop > 4)


def test_rows_nobody_saved_start_fresh(tmp_path):
    files = [_save(tmp_path, 0, remap.Rows(0, 4, 2))]
    carry, missing, used = remap.regroup_carry(
        [(files[0], remap.Rows(0, 4, 2), sorted(_carry(remap.Rows(0, 4, 2))))],
        remap.Rows(0, 8, 2))
    assert missing == [2, 3] and sorted(carry) == sorted(_carry(remap.Rows(0, 4, 2)))
    assert used == {"rank_00000.safetensors"}


def test_guard_state_comes_from_the_process_of_the_first_row(tmp_path):
    files = [_save(tmp_path, 0, remap.Rows(0, 4, 2), guard={"ema": 1.0, "aborted": False}),
             _save(tmp_path, 1, remap.Rows(4, 8, 2), guard={"ema": 2.0, "aborted": False})]
    mapped = remap.map_rank_state(tmp_path, files, 5, remap.Rows(4, 8, 2), {"spike"})
    assert mapped.payload["guard_fields"]["spike"]["ema"] == 2.0
    assert "rank_00001.safetensors" in mapped.notes[0]


def test_no_carry_saved_means_none(tmp_path):
    files = [_save(tmp_path, 0, remap.Rows(0, 4, 4), carry=False),
             _save(tmp_path, 1, remap.Rows(4, 8, 4), carry=False)]
    mapped = remap.map_rank_state(tmp_path, files, 5, remap.Rows(0, 8, 8), {"spike"})
    assert mapped.payload["carry"] is None


def test_errors_are_clear(tmp_path, two_ranks):
    with pytest.raises(CheckpointError, match="does not match the train progress step"):
        remap.map_rank_state(tmp_path, two_ranks, 6, remap.Rows(0, 8, 8), {"spike"})
    with pytest.raises(CheckpointError, match="differ from the recipe"):
        remap.map_rank_state(tmp_path, two_ranks, 5, remap.Rows(0, 8, 8), {"other"})
    with pytest.raises(CheckpointError, match="no saved process trained global batch row 8"):
        remap.map_rank_state(tmp_path, two_ranks, 5, remap.Rows(8, 16, 8), {"spike"})
    with pytest.raises(CheckpointError, match="malformed batch rows"):
        remap.rows_of({"rows": [4, 2], "micro_batch": 2})


def test_a_checkpoint_without_rows_cannot_be_mapped(tmp_path):
    path = _save(tmp_path, 0, remap.Rows(0, 4, 2))
    tensors, header = storage.load_rank_file(path)
    del header["batch"]
    storage.save_rank_file(path, tensors, header)
    with pytest.raises(CheckpointError, match="resume it with 1 processes"):
        remap.map_rank_state(tmp_path, [path], 5, remap.Rows(0, 4, 4), {"spike"})


def test_layout_report_names_what_changed():
    two = {"world_size": 2, "mesh": {"dp_replicate": 1, "dp_shard": 2}, "fsdp": True,
           "global_batch": 8, "micro_batch": 2, "grad_accum": 2}
    one = {"world_size": 1, "mesh": {}, "fsdp": False, "global_batch": 8, "micro_batch": 4,
           "grad_accum": 2}
    lines = remap.describe_change(two, one)
    assert lines[0].startswith("layout: 2 processes, dp_replicate=1 x dp_shard=2, FSDP -> "
                               "1 process;")
    assert lines[1].startswith("micro_batch: 2 -> 4 per rank")
    assert len(lines) == 2 and remap.describe_change(two, dict(two)) == []
    assert remap.describe_change(None, one) == []
