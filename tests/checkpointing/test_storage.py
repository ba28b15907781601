"""Pickle-free storage: tensor/JSON split, the allow-list DCP index reader, no byte items."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kiln.checkpointing import storage
from kiln.components.errors import CheckpointError


def test_split_and_merge_round_trip():
    tree = {"model": {"w": torch.ones(2)}, "opt": {"state": {"w": {"step": torch.tensor(3.0),
            "count": 4}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]}}
    tensors, rest = storage.split_tree(tree)
    assert tensors == {"model": {"w": tree["model"]["w"]},
                       "opt": {"state": {"w": {"step": tree["opt"]["state"]["w"]["step"]}}}}
    assert rest["opt"]["param_groups"][0]["betas"] == [0.9, 0.95]
    assert rest["opt"]["state"]["w"] == {"count": 4}
    merged = storage.merge_tree(tensors, rest)
    assert merged["opt"]["state"]["w"]["count"] == 4 and merged["model"]["w"] is tree["model"]["w"]


@pytest.mark.parametrize("value", [object(), float("nan"), {1: 2}.keys()])
def test_values_that_would_need_pickle_are_refused(value):
    with pytest.raises(CheckpointError, match="cannot save|no pickle"):
        storage.split_tree({"x": value})


def _save(folder, sd):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(folder), no_dist=True)


def _load(folder, sd):
    storage.load_tensors(sd, folder, no_dist=True)


def test_safe_reader_loads_what_dcp_wrote(tmp_path):
    _save(tmp_path, {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)})
    sd = {"a": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    _load(tmp_path, sd)
    assert torch.equal(sd["a"], torch.arange(6.0).view(2, 3)) and sd["b"].sum() == 2


def test_the_index_is_read_and_unpickled_once(tmp_path, monkeypatch):
    _save(tmp_path, {"a": torch.arange(4.0)})
    reads = []
    real = storage._MetadataUnpickler.load
    monkeypatch.setattr(storage._MetadataUnpickler, "load",
                        lambda self: reads.append(1) or real(self))
    sd = {"a": torch.zeros(4)}
    _load(tmp_path, sd)
    assert len(reads) == 1 and torch.equal(sd["a"], torch.arange(4.0))


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_tampered_index_is_never_unpickled(tmp_path, capsys):
    _save(tmp_path, {"a": torch.ones(2)})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="tampered"):
        _load(tmp_path, {"a": torch.zeros(2)})
    assert "pwned" not in capsys.readouterr().out


def test_a_truncated_index_is_a_clear_error(tmp_path):
    _save(tmp_path, {"a": torch.ones(2)})
    data = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable DCP index"):
        _load(tmp_path, {"a": torch.zeros(2)})


def test_byte_items_are_refused(tmp_path):
    _save(tmp_path, {"a": torch.ones(2), "b": {"x": 1}})  # DCP pickles non-tensors
    with pytest.raises(CheckpointError, match="pickled bytes"):
        _load(tmp_path, {"a": torch.zeros(2), "b": {"x": 0}})


def test_rank_file_errors(tmp_path):
    with pytest.raises(CheckpointError, match="missing"):
        storage.load_rank_file(tmp_path / "nope.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        storage.load_rank_file(tmp_path / "bad.safetensors")
