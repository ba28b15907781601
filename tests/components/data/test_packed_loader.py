"""The packed-document loader's own arithmetic: window reads, micro-batch location, the cursor
and its state round trip (the dataset-level behaviour is in test_packed_documents.py)."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch

from kiln.components.data.packed_loader import Loader, Windows, _check_batch_plan, _locate
from kiln.components.errors import DataError, RecipeError

from .conftest import epoch_stream

L = 8


def test_locate_walks_steps_ranks_and_epochs():
    # per_step=2 micro-batches, 3 steps an epoch, GB=8, 4 windows a rank, rank 1, mb=2
    plan = (2, 3, 8, 4, 1, 2)
    assert _locate(0, *plan) == (0, 4, 2)  # rank 1 starts half-way into the global batch
    assert _locate(1, *plan) == (0, 6, 2)
    assert _locate(2, *plan) == (0, 12, 2)  # step 1
    assert _locate(5, *plan) == (0, 22, 2)
    assert _locate(6, *plan) == (1, 4, 2)  # the next data epoch restarts at its window 0


@pytest.mark.parametrize(("mb", "gb", "rank", "world"), [(0, 8, 0, 1), (2, 8, 2, 2), (3, 8, 0, 1),
                                                        (2, 6, 0, 2)])
def test_bad_batch_plans_are_rejected(mb, gb, rank, world):
    with pytest.raises(RecipeError):
        _check_batch_plan(mb, gb, rank, world)


def test_windows_read_the_epoch_stream_and_pickle_light(make_dataset):
    ds = make_dataset(seq_len=L)
    win = Windows(ds.layout, "train", L)
    for epoch in (0, 1):
        stream = epoch_stream(ds, "train", epoch)
        got = win.read(epoch, 3, 2)  # windows 3 and 4
        assert got.dtype == np.int64 and got.shape == (2, L + 1)
        assert np.array_equal(got[0], stream[3 * L:4 * L + 1])
        assert np.array_equal(got[1], stream[4 * L:5 * L + 1])
    state = pickle.loads(pickle.dumps(win))
    assert state._tokens is None and state._layout is None and state._orders == {}
    assert np.array_equal(state.read(1, 3, 2), win.read(1, 3, 2))  # reopens lazily


def loader(ds, **kw) -> Loader:
    args = {"seq_len": L, "micro_batch": 2, "global_batch": 8, "rank": 0, "world_size": 1, **kw}
    return Loader(ds.layout, "train", **args)


def test_position_state_dict_and_seek(make_dataset):
    ds = make_dataset(seq_len=L)
    a = loader(ds)
    assert a.micro_per_step == 4 and len(a) == a.steps_per_epoch * 4
    n = a.steps_per_epoch * 4 + 6  # into data epoch 1, step 1, micro 2
    list(itertools.islice(a, n))
    assert a.position == (1, 1, 2)
    state = a.state_dict()
    assert state["data_epoch"] == 1 and state["step"] == 1 and state["micro"] == 2
    b = loader(ds)
    b.load_state_dict(state)
    for x, y in zip(itertools.islice(a, 3), itertools.islice(b, 3), strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
    # b consumed 3 more micro-batches: data epoch 1, micro-batch 2 + 3 = 5 -> step 2, micro 1
    assert b.position == (1, 2, 1)
    b.skip_steps(2)  # two global steps later, same micro-batch within the step
    e, s = divmod(b.steps_per_epoch + 4, b.steps_per_epoch)
    assert b.position == (e, s, 1)
    with pytest.raises(ValueError):
        b.skip_steps(-1)


def test_state_dict_checks(make_dataset):
    ds = make_dataset(seq_len=L)
    a = loader(ds)
    next(iter(a))
    mid_step = a.state_dict()
    with pytest.raises(DataError, match="step boundary"):
        loader(ds, micro_batch=4).load_state_dict(mid_step)
    with pytest.raises(DataError, match="global_batch"):
        loader(ds, global_batch=16, micro_batch=4).load_state_dict(mid_step)
    list(itertools.islice(a, 3))  # now at a step boundary: another micro_batch may resume
    c = loader(ds, micro_batch=4)
    c.load_state_dict(a.state_dict())
    assert c.position == (0, 1, 0)


def test_too_small_split_is_a_data_error(make_dataset):
    ds = make_dataset(seq_len=L)
    with pytest.raises(DataError, match="fewer than one global batch"):
        loader(ds, global_batch=1 << 16, micro_batch=1 << 16)


def test_batches_carry_each_tokens_document(make_dataset):
    """``doc_ids`` number the documents of each row from 0; every document of the layout starts
    with BOS, so a new id begins exactly at each BOS after the row's first token."""
    from kiln.components.data import documents

    ds = make_dataset(seq_len=32)
    epoch = loader(ds, micro_batch=2, global_batch=8)
    batches = list(itertools.islice(epoch, len(epoch)))
    changes = 0
    for b in batches:
        ids, docs = b["input_ids"], b["doc_ids"]
        assert docs.dtype == torch.int32 and docs.shape == ids.shape and (docs[:, 0] == 0).all()
        want = documents.from_bos(ids.numpy(), ds.tokenizer.bos_id)
        assert np.array_equal(docs.numpy(), want)
        changes += int((docs[:, 1:] != docs[:, :-1]).sum())
    assert changes > 10  # short documents: many boundaries, so the check is not vacuous


@pytest.mark.parametrize(("edit", "says"), [
    (lambda s: s.pop("seq_len"), "seq_len: Field required"),
    (lambda s: s.update(step=True), "step: Input should be a valid integer"),
    (lambda s: s.update(micro=-1), "micro: Input should be greater than or equal to 0"),
    (lambda s: s.update(extra=1), "extra: Extra inputs are not permitted"),
])
def test_a_malformed_cursor_is_one_data_error_and_changes_nothing(make_dataset, edit, says):
    ds = make_dataset(seq_len=L)
    a = loader(ds)
    list(itertools.islice(a, 5))
    state = a.state_dict()
    edit(state)
    b = loader(ds)
    next(b)
    for call in (b.check_state_dict, b.load_state_dict):
        with pytest.raises(DataError, match=f"malformed data loader cursor \\({says}"):
            call(state)
    assert b.position == (0, 0, 1)
