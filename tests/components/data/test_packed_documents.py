from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from kiln.components.data.packed_documents import PackedDocumentsConfig
from kiln.components.errors import DataError, RecipeError
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer

from .conftest import epoch_stream

GB, MB, L = 8, 2, 8


def take(loader, n):
    return list(itertools.islice(loader, n))


def global_batches(ds, world_size, steps, split="train", gb=GB, mb=MB):
    """The first ``steps`` global batches as every rank together sees them: (GB, L) tensors."""
    per_rank = []
    for rank in range(world_size):
        loader = ds.loader(split, micro_batch=mb, global_batch=gb, rank=rank,
                           world_size=world_size)
        per_rank.append(take(loader, steps * loader.micro_per_step))
    k = gb // world_size // mb
    out = []
    for g in range(steps):
        parts = [b for r in per_rank for b in r[g * k:(g + 1) * k]]
        out.append({key: torch.cat([p[key] for p in parts]) for key in ("input_ids", "labels")})
    return out


def test_batches_are_shifted_windows(make_dataset):
    ds = make_dataset(seq_len=L)
    batch = next(iter(ds.loader("train", micro_batch=MB, global_batch=GB, rank=0, world_size=1)))
    assert batch["input_ids"].shape == batch["labels"].shape == (MB, L)
    assert batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"][0, 1:], batch["labels"][0, :-1])
    assert torch.equal(batch["labels"][0, -1], batch["input_ids"][1, 0])  # windows share 1 token


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_train_token_once_per_epoch(make_dataset, world_size):
    ds = make_dataset(seq_len=L)
    loader = ds.loader("train", micro_batch=MB, global_batch=GB, rank=0, world_size=world_size)
    steps = loader.steps_per_epoch
    stream = epoch_stream(ds, "train", 0)
    assert len(stream) == loader.tokens_per_epoch == ds.tokens_per_epoch
    assert loader.windows_per_epoch == ds.windows_per_epoch == (len(stream) - 1) // L
    batches = global_batches(ds, world_size, steps + 1)
    seen = torch.cat([b["input_ids"].flatten() for b in batches[:steps]]).numpy()
    labels = torch.cat([b["labels"].flatten() for b in batches[:steps]]).numpy()
    n = steps * GB * L
    assert np.array_equal(seen, stream[:n]) and np.array_equal(labels, stream[1:n + 1])
    assert len(stream) - n < (GB + 1) * L + 1  # only the incomplete last global batch dropped
    # then the next data epoch starts from the beginning of its own order
    nxt = epoch_stream(ds, "train", 1)
    assert np.array_equal(batches[steps]["input_ids"].flatten().numpy(), nxt[:GB * L])


def test_one_and_two_ranks_see_the_same_global_batches(make_dataset):
    ds = make_dataset(seq_len=L)
    one, two = global_batches(ds, 1, 5), global_batches(ds, 2, 5)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_deterministic_per_seed(make_dataset):
    a, b, c = (take(make_dataset(seq_len=L, seed=s).loader(
        "train", micro_batch=MB, global_batch=GB), 4) for s in (3, 3, 4))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c, strict=True))


def test_epochs_cycle_through_the_orders_written(make_dataset):
    ds = make_dataset(seq_len=L, num_epochs=2)
    loader = ds.loader("train", micro_batch=MB, global_batch=GB)
    loader.skip_steps(2 * loader.steps_per_epoch)
    assert loader.state_dict()["data_epoch"] == 2
    first = ds.loader("train", micro_batch=MB, global_batch=GB)
    assert torch.equal(next(loader)["input_ids"], next(first)["input_ids"])


@pytest.mark.parametrize(("world_size", "offset"), [(1, 3), (2, -1), (2, 0), (4, -2)])
def test_resume_is_exact(make_dataset, world_size, offset):
    """Iterate k micro-batches, save, load into a new loader: the next ones match an
    uninterrupted loader, also across the end of a data epoch (offset counts from it)."""
    ds = make_dataset(seq_len=L)
    make = lambda: ds.loader("train", micro_batch=MB, global_batch=GB, rank=world_size - 1,
                             world_size=world_size)
    ref = make()
    k = offset % ref.steps_per_epoch if offset > 0 else ref.steps_per_epoch + offset
    k *= ref.micro_per_step
    expected = take(ref, k + 6)[k:]
    first = make()
    take(first, k)
    state = first.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for a, b in zip(take(resumed, 6), expected, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_resume_mid_step_and_with_another_world_size(make_dataset):
    ds = make_dataset(seq_len=L)
    one = ds.loader("train", micro_batch=MB, global_batch=GB)
    take(one, 3 * one.micro_per_step)  # 3 whole steps
    two = ds.loader("train", micro_batch=MB, global_batch=GB, rank=1, world_size=2)
    two.load_state_dict(one.state_dict())  # a step boundary: any world size may resume
    step3 = global_batches(ds, 1, 4)[3]["input_ids"]  # (GB, L)
    assert torch.equal(next(two)["input_ids"], step3[GB // 2:GB // 2 + MB])
    assert torch.equal(next(one)["input_ids"], step3[:MB])
    mid = one.state_dict()
    assert mid["micro"] == 1
    with pytest.raises(DataError, match="step boundary"):
        two.load_state_dict(mid)
    with pytest.raises(DataError, match="global_batch"):
        ds.loader("train", micro_batch=MB, global_batch=16).load_state_dict(mid)


def test_skip_steps(make_dataset):
    ds = make_dataset(seq_len=L)
    ref, skipped = (ds.loader("train", micro_batch=MB, global_batch=GB) for _ in range(2))
    per_step = ref.micro_per_step
    skipped.skip_steps(ref.steps_per_epoch + 2)
    expected = take(ref, (ref.steps_per_epoch + 3) * per_step)[-per_step:]
    assert skipped.state_dict()["data_epoch"] == 1 and skipped.state_dict()["step"] == 2
    for a, b in zip(take(skipped, per_step), expected, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_workers_give_the_same_batches_and_resume(make_dataset):
    plain = make_dataset(seq_len=L)
    workers = make_dataset(seq_len=L, num_workers=2)
    expected = take(plain.loader("train", micro_batch=MB, global_batch=GB), 12)
    loader = workers.loader("train", micro_batch=MB, global_batch=GB)
    got = take(loader, 5)
    state = loader.state_dict()
    again = workers.loader("train", micro_batch=MB, global_batch=GB)
    again.load_state_dict(state)
    got += take(again, 7)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, expected,
                                                                           strict=True))


def test_eval_split(make_dataset):
    ds = make_dataset(seq_len=4, eval_fraction=0.25)
    loader = ds.loader("eval", micro_batch=1, global_batch=2, rank=0, world_size=1)
    first, second = list(loader), list(loader)  # each pass starts from the beginning
    assert len(first) == len(loader) == loader.steps_per_epoch * 2
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, second,
                                                                           strict=True))
    stream = epoch_stream(ds, "eval", 0)
    assert np.array_equal(torch.cat([b["input_ids"].flatten() for b in first]).numpy(),
                          stream[:len(first) * 4])
    batches = global_batches(ds, 2, loader.steps_per_epoch, split="eval", gb=2, mb=1)
    pairs = zip(first[::2], first[1::2], strict=True)
    one_rank = [torch.cat([a["input_ids"], b["input_ids"]]) for a, b in pairs]
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(one_rank, batches, strict=True))
    held_out = set(ds.layout.order("eval")[0].tolist())
    assert held_out and not held_out & set(ds.layout.order("train", 0)[0].tolist())


def test_batch_plan_errors(make_dataset):
    ds = make_dataset(seq_len=L)
    with pytest.raises(RecipeError, match="divisible"):
        ds.loader("train", micro_batch=3, global_batch=8, rank=0, world_size=2)
    with pytest.raises(DataError, match="fewer than one global batch"):
        ds.loader("train", micro_batch=1, global_batch=100_000)


def test_cache_is_reused(make_dataset, monkeypatch):
    ds = make_dataset(seq_len=L)
    assert make_dataset(seq_len=L, seed=1).folder != ds.folder
    stamp = (ds.folder / "metadata.json").stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(type(ds), "build", lambda self, folder: calls.append(folder))
    again = make_dataset(seq_len=16)  # seq_len is not part of the key
    assert again.folder == ds.folder and calls == []
    assert (ds.folder / "metadata.json").stat().st_mtime_ns == stamp


def test_explicit_path_is_not_built_silently(tmp_path, corpus):
    cfg = PackedDocumentsConfig(type="packed_documents", path=str(tmp_path / "mine"),
                                source="folder", source_path=str(corpus))
    ds = cfg.build(tokenizer=ByteTokenizer(), seq_len=L, seed=0)
    with pytest.raises(DataError, match=r"kiln data prepare .*--input .*--out"):
        ds.prepare()
    assert ds.prepare(create=True) == tmp_path / "mine"
    assert (tmp_path / "mine" / "metadata.json").is_file()


def test_default_stdlib_source_small(tmp_path):
    cfg = PackedDocumentsConfig(type="packed_documents", max_bytes=60_000,
                                cache_dir=str(tmp_path))
    ds = cfg.build(tokenizer=ByteTokenizer(), seq_len=32, seed=0)
    folder = ds.prepare()
    assert folder.parent == tmp_path / "packed" and folder.name.startswith("stdlib-")
    assert 0 < ds.meta["total_tokens"] <= 60_000 + 2 * ds.meta["num_docs"]
    batch = next(ds.loader("train", micro_batch=2, global_batch=4))
    assert batch["input_ids"].shape == (2, 32)


def test_concurrent_prepare_builds_once(tmp_path, corpus, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from kiln.components.data.packed_documents import PackedDocuments

    builds = []
    real_build = PackedDocuments.build
    monkeypatch.setattr(PackedDocuments, "build",
                        lambda self, folder: builds.append(folder) or real_build(self, folder))
    cfg = PackedDocumentsConfig(type="packed_documents", source="folder",
                                source_path=str(corpus), cache_dir=str(tmp_path / "cache"))
    datasets = [cfg.build(tokenizer=ByteTokenizer(), seq_len=L, seed=0) for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda ds: ds.prepare(), datasets))
    assert len(set(folders)) == 1 and len(builds) == 1


def test_an_eval_split_too_small_for_one_batch_says_what_to_change(tmp_path, make_dataset):
    """The eval loader's batch is micro_batch rows per rank: the message gives those numbers
    and the eval_fraction to hold out, in the words of a cache build or a prepared folder."""
    ds = make_dataset(seq_len=L)
    with pytest.raises(DataError) as err:
        ds.loader("eval", micro_batch=64, global_batch=64)
    msg = str(err.value)
    assert f"the eval split has {ds.meta['splits']['eval']['tokens']:,} tokens (4 documents)" in msg
    assert "64 x 8 + 1 = 513 tokens (training.micro_batch x training.seq_len + 1)" in msg
    assert "(data.eval_fraction = 0.2" in msg and "now 0.1)" in msg and "eval.interval = 0" in msg
    cfg = PackedDocumentsConfig(type="packed_documents", path=str(ds.folder))
    prepared = cfg.build(tokenizer=ByteTokenizer(), seq_len=L, seed=0)
    with pytest.raises(DataError) as err:
        prepared.loader("eval", micro_batch=32, global_batch=64, world_size=2)
    msg = str(err.value)
    assert "32 x 2 x 8 + 1 = 513 tokens (training.micro_batch x data-parallel ranks" in msg
    assert "`kiln data prepare ... --eval-fraction 0.2" in msg and "data.eval_fraction" not in msg


def test_the_suggested_eval_fraction_holds_out_more_than_now():
    """A random split of a few documents can be short by chance: one 99-token document at 2%
    of 50 (the average document holds 6,000 tokens). The suggestion is above the current share
    and holds out at least one document more, not the 1% the average alone would give."""
    from kiln.components.data.layout_fit import suggest_eval_fraction, too_small

    meta = {"total_tokens": 300_000, "num_docs": 50, "eval_fraction": 0.02,
            "splits": {"eval": {"tokens": 99, "docs": 1}}}
    msg = too_small(meta, "eval", seq_len=256, global_batch=4, world_size=1, prepared=False)
    assert "(data.eval_fraction = 0.04; now 0.02)" in msg
    assert suggest_eval_fraction(300_000, 1025) == 0.01  # the average alone
    tail = {**meta, "eval_split": "tail", "eval_fraction": 0.001}  # tokens, not documents
    assert "(data.eval_fraction = 0.01; now 0.001)" in too_small(
        tail, "eval", seq_len=256, global_batch=4, world_size=1, prepared=False)
    assert suggest_eval_fraction(10_000, 1025, now=0.2) == 0.21
