"""streaming_text: lanes of documents tokenised on the fly; the same global batches for 1 and 2
processes and any number of loader workers; exact resume through the StatefulDataLoader state
(JSON) without re-reading consumed input; eval split and bits per byte."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.components.base import default_config
from kiln.components.errors import DataError, RecipeError
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from tests.components.data.corpora import DOCS, write_jsonl, write_parquet

GB, MB, L = 8, 2, 16


@pytest.fixture
def inputs(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", DOCS[:20])
    write_parquet(tmp_path / "in" / "b.parquet", DOCS[20:40], row_group_size=7)
    write_jsonl(tmp_path / "in" / "c.jsonl.gz", DOCS[40:], compress="gz")
    return tmp_path / "in"


def _ds(inputs, tok=None, **kw):
    cfg = default_config("dataset", "streaming_text", inputs=[str(inputs)], eval_docs=4,
                         batch_docs=3, **kw)
    ds = cfg.build(tokenizer=tok or ByteTokenizer(), seq_len=L)
    ds.prepare()
    return ds


def _take(loader, n):
    it = iter(loader)
    return [next(it)["input_ids"] for _ in range(n)]


def _global_rows(inputs, steps, world, **kw):
    """The global batches of ``steps`` steps, ranks' micro-batches put back together."""
    per = GB // world // MB
    ranks = [_take(_ds(inputs, **kw).loader("train", micro_batch=MB, global_batch=GB, rank=r,
                                            world_size=world), steps * per)
             for r in range(world)]
    return torch.cat([torch.cat(r[s * per:(s + 1) * per]) for s in range(steps)
                      for r in ranks])


def test_lane_rows_are_document_streams(inputs):
    rows = _global_rows(inputs, 3, 1)
    tok = ByteTokenizer()
    assert rows.shape == (3 * GB, L)
    assert tok.decode(rows[0].tolist()) == DOCS[4][:L - 1]  # lane 0 starts at train doc 0
    assert rows[0, 0] == tok.bos_id and tok.decode(rows[1].tolist()) == DOCS[5][:L - 1]
    assert tok.decode(rows[GB].tolist()) == DOCS[4][L - 1:2 * L - 1]  # its next window


def test_one_and_two_processes_and_workers_see_the_same_global_batches(inputs):
    one = _global_rows(inputs, 12, 1)
    assert torch.equal(one, _global_rows(inputs, 12, 2))
    assert torch.equal(one, _global_rows(inputs, 12, 1, num_workers=2))
    assert torch.equal(one, _global_rows(inputs, 12, 2, num_workers=2))


@pytest.mark.parametrize("world, workers", [(1, 0), (1, 2), (2, 0), (2, 2)])
def test_exact_resume_from_the_json_state(inputs, world, workers):
    for rank in range(world):
        for cut in (1, 7, 90):  # 90 micro-batches wrap around the inputs (a second pass)
            kw = {"micro_batch": MB, "global_batch": GB, "rank": rank, "world_size": world}
            a = _ds(inputs, num_workers=workers).loader("train", **kw)
            it = iter(a)
            for _ in range(cut):
                next(it)
            state = json.loads(json.dumps(a.state_dict()))
            expected = [next(it)["input_ids"] for _ in range(6)]
            b = _ds(inputs, num_workers=workers).loader("train", **kw)
            b.load_state_dict(state)
            assert all(torch.equal(x, y) for x, y in zip(_take(b, 6), expected, strict=True))


def test_resume_does_not_reread_consumed_input(inputs):
    kw = {"micro_batch": MB, "global_batch": GB}
    a = _ds(inputs).loader("train", **kw)
    it = iter(a)
    state = None
    for _ in range(200):
        next(it)
        state = a.state_dict()
        lanes = state["loader"]["dataset_state"]["lanes"].values()
        addrs = [v["addr"] for v in lanes]
        if all(addrs) and min(a[1] for a in addrs) == 1 and all(a[0] == 0 for a in addrs):
            break  # every lane is past the first file
    else:
        pytest.fail("the lanes never all left the first file")
    expected = _take(a, 4)
    (inputs / "a.jsonl").write_text("not json\n" * 20)  # reading it again would fail
    b = _ds(inputs).loader("train", **kw)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(x, y) for x, y in zip(_take(b, 4), expected, strict=True))


def test_mismatched_cursor_and_worker_plan_are_errors(inputs):
    a = _ds(inputs).loader("train", micro_batch=MB, global_batch=GB)
    _take(a, 2)
    b = _ds(inputs).loader("train", micro_batch=MB, global_batch=GB, rank=0, world_size=2)
    with pytest.raises(DataError, match="world_size = 1"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(RecipeError, match="num_workers = 3 must divide"):
        _ds(inputs, num_workers=3).loader("train", micro_batch=MB, global_batch=GB)
    with pytest.raises(RecipeError, match="needs data.inputs"):
        default_config("dataset", "streaming_text").build(tokenizer=ByteTokenizer(), seq_len=L)


def test_eval_split_is_held_out_and_knows_its_bytes(inputs):
    ds = _ds(inputs)
    batches = list(ds.loader("eval", micro_batch=MB, global_batch=MB))
    tok = ByteTokenizer()
    assert tok.decode(batches[0]["input_ids"][0].tolist()) == DOCS[0][:L - 1]
    eval_bytes = sum(len(d.encode()) for d in DOCS[:4])
    assert ds.tokens_per_byte() == pytest.approx((eval_bytes + 8) / eval_bytes)
    train = torch.cat(_take(ds.loader("train", micro_batch=MB, global_batch=GB), 8))
    assert not any(tok.decode(r.tolist()).startswith("document 0:") for r in train)


def test_no_training_documents_is_an_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:3])
    ds = _ds(tmp_path / "a.jsonl")
    with pytest.raises(DataError, match="no training documents after the first data.eval_docs "
                                        "= 4; add data"):
        _take(ds.loader("train", micro_batch=MB, global_batch=GB), 1)


def test_inputs_that_are_all_skipped_say_so(tmp_path):
    """Input that is not UTF-8 is skipped (data.on_invalid_utf8 = "skip"): where nothing is
    left, the messages say what was skipped and where, not that eval_docs is 0."""
    (tmp_path / "bytes.txt").write_bytes(bytes(range(128, 256)) * 8)
    ds = _ds(tmp_path / "bytes.txt")
    with pytest.raises(DataError, match=r"no document to hold out for evaluation \(data."
                                        r"eval_docs = 4\) \(1 not UTF-8 .*bytes.txt"):
        ds.tokens_per_byte()
    with pytest.raises(DataError, match=r"no training documents .*\(1 not UTF-8 .*bytes.txt"):
        _take(ds.loader("train", micro_batch=MB, global_batch=GB), 1)


def test_windows_carry_their_documents(inputs):
    """A lane window's ``doc_ids`` change where its next document (its BOS) begins."""
    from kiln.components.data import documents

    tok = ByteTokenizer()
    ds = _ds(inputs)
    it = iter(ds.loader("train", micro_batch=MB, global_batch=GB))
    evals = list(ds.loader("eval", micro_batch=MB, global_batch=MB))
    changes = 0
    for b in [next(it) for _ in range(12)] + evals:
        ids, docs = b["input_ids"].numpy(), b["doc_ids"].numpy()
        assert docs.shape == ids.shape and (docs[:, 0] == 0).all()
        assert (docs == documents.from_bos(ids, tok.bos_id)).all()
        changes += int((docs[:, 1:] != docs[:, :-1]).sum())
    assert changes >= 3  # documents of 20-160 tokens in rows of 16: boundaries occur


def test_a_malformed_cursor_is_one_data_error(inputs):
    a = _ds(inputs).loader("train", micro_batch=MB, global_batch=GB)
    _take(a, 1)
    state = a.state_dict()
    state["loader"] = None
    with pytest.raises(DataError, match="loader: Input should be an object"):
        _ds(inputs).loader("train", micro_batch=MB, global_batch=GB).load_state_dict(state)
