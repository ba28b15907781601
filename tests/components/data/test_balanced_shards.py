"""balanced_shards: equal tokens per domain, the global-step sharding rule, held-out eval rows,
shards picked up while training, exact resume, the Hub path offline."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.components.base import default_config
from kiln.components.errors import DataError, RecipeError

L = 8  # seq_len
DOMAINS = ["code", "math", "web"]


def tag(domain: int, shard: int, row: int) -> int:
    return domain * 10000 + shard * 1000 + row


def write_shard(root: Path, d: int, s: int, rows: int = 20, one_d: bool = False) -> Path:
    """Rows whose first token tags (domain, shard, row); the rest count up from it."""
    folder = root / DOMAINS[d]
    folder.mkdir(parents=True, exist_ok=True)
    arr = np.array([[tag(d, s, r) + i for i in range(L + 3)] for r in range(rows)], np.uint16)
    if one_d:  # a stream whose windows of L + 1 (stride L) start with the same tags
        arr = np.concatenate([np.r_[tag(d, s, r), np.arange(1, L)] for r in range(rows)]
                             + [np.array([0])]).astype(np.int32)
    path = folder / f"shard_{s:03d}.npy"
    np.save(path, arr)
    return path


@pytest.fixture
def root(tmp_path) -> Path:
    for d in range(3):
        for s in range(2):
            write_shard(tmp_path / "data", d, s)
    return tmp_path / "data"


def dataset(root: Path, **values):
    values = {"path": str(root), "domains": DOMAINS, "eval_rows": 4, **values}
    if values.get("repo_id"):
        values.pop("path")
    cfg = default_config("dataset", "balanced_shards", **values)
    ds = cfg.build(tokenizer=None, seq_len=L, seed=0)
    ds.prepare()
    return ds


def tags(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def test_batches_are_shifted_windows_with_equal_rows_per_domain(root):
    loader = dataset(root).loader("train", micro_batch=6, global_batch=6)
    for _ in range(5):
        b = next(loader)
        assert b["input_ids"].shape == b["labels"].shape == (6, L)
        assert b["input_ids"].dtype == torch.int64
        assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
        assert sorted(t // 10000 for t in tags(b)) == [0, 0, 1, 1, 2, 2]  # round robin


def test_two_ranks_take_contiguous_slices_of_the_same_global_batch(root):
    ds = dataset(root)
    single = ds.loader("train", micro_batch=2, global_batch=12)
    ranks = [ds.loader("train", micro_batch=3, global_batch=12, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(4):  # steps
        full = sum((tags(next(single)) for _ in range(6)), [])
        split = sum((tags(next(ranks[r])) for r in range(2) for _ in range(2)), [])
        assert full == split


def test_eval_rows_are_held_out(root):
    ds = dataset(root)
    held = {tag(d, 0, r) for d in range(3) for r in range(4)}
    train = ds.loader("train", micro_batch=6, global_batch=6)
    seen = [t for _ in range(40) for t in tags(next(train))]  # 240 rows > a full pass (108)
    assert not held & set(seen)
    assert {t // 1000 % 10 for t in seen} == {0, 1}  # both shards of every domain
    ev = ds.loader("eval", micro_batch=2, global_batch=6, rank=1, world_size=3)
    assert len(ev) == 2  # 12 eval rows / global batch 6 = 2 steps, one micro-batch each
    got = [t for b in ev for t in tags(b)]
    assert set(got) <= held and len(got) == 4
    assert [t for b in ev for t in tags(b)] == got  # one fresh pass per iteration


def test_the_eval_fingerprint_is_the_held_out_rows(root, tmp_path):
    base = dataset(root).eval_fingerprints()
    assert dataset(root).eval_fingerprints() == base and base
    assert dataset(root, eval_rows=5).eval_fingerprints() != base
    write_shard(tmp_path / "moved", 0, 1)  # each domain's first shard is another one
    for d in (1, 2):
        write_shard(tmp_path / "moved", d, 0)
    assert dataset(tmp_path / "moved").eval_fingerprints() != base
    assert dataset(root, eval_rows=0).eval_fingerprints() == {}


def test_one_pass_covers_every_train_row_once(root):
    ds = dataset(root, shuffle=False)
    train = ds.loader("train", micro_batch=6, global_batch=6)
    first_pass = [t for _ in range(6) for t in tags(next(train))]  # 36 rows per domain
    assert len(set(first_pass)) == 36
    assert [t for t in first_pass if t // 10000 == 0][:3] == [tag(0, 0, 4), tag(0, 0, 5),
                                                               tag(0, 0, 6)]


def test_new_shards_are_picked_up_between_shards(tmp_path):
    root = tmp_path / "data"
    for d in range(3):
        write_shard(root, d, 0)
    train = dataset(root, eval_rows=0).loader("train", micro_batch=3, global_batch=3)
    for _ in range(3):
        next(train)
    for d in range(3):
        write_shard(root, d, 5)  # uploaded while training
    seen = [t for _ in range(40) for t in tags(next(train))]  # the first shards end at 20 rows
    assert {t // 1000 % 10 for t in seen} == {0, 5}
    assert train.streams["code"].seen == ["code/shard_000.npy", "code/shard_005.npy"]


def test_resume_from_a_json_state_is_exact(root):
    ds = dataset(root)
    a = ds.loader("train", micro_batch=2, global_batch=6)
    for _ in range(17):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # plain data
    expected = [tags(next(a)) for _ in range(30)]
    b = dataset(root).loader("train", micro_batch=2, global_batch=6)
    b.load_state_dict(state)
    assert [tags(next(b)) for _ in range(30)] == expected
    assert len(a.streams["code"].entries) <= 2  # consumed shards are dropped from the state


def test_resume_at_a_step_boundary_with_another_world_size(root):
    ds = dataset(root)
    one = ds.loader("train", micro_batch=3, global_batch=6)
    for _ in range(2 * 9):  # 9 steps
        next(one)
    state = one.state_dict()
    expected = [t for _ in range(2) for t in tags(next(one))]
    halves = []
    for r in range(2):
        other = ds.loader("train", micro_batch=3, global_batch=6, rank=r, world_size=2)
        other.load_state_dict(state)
        halves += tags(next(other))
    assert halves == expected


def test_one_dimensional_stream_shards(tmp_path):
    root = tmp_path / "data"
    for d in range(3):
        write_shard(root, d, 0, rows=10, one_d=True)
    ds = dataset(root, eval_rows=2, shuffle=False)
    b = next(ds.loader("train", micro_batch=3, global_batch=3))
    assert tags(b) == [tag(0, 0, 2), tag(1, 0, 2), tag(2, 0, 2)]
    assert b["labels"][0, -1].item() == tag(0, 0, 3)  # the window's extra token: next row's tag


def test_errors_say_what_to_fix(tmp_path):
    root = tmp_path / "data"
    write_shard(root, 0, 0)
    with pytest.raises(DataError, match="no .npy shards for domain 'math'"):
        dataset(root)
    np.save(root / "code" / "shard_000.npy", np.zeros((4, L), np.uint16))  # rows too short
    with pytest.raises(DataError, match=r"needs 9 \(inputs"):
        dataset(root, domains=["code"], eval_rows=1)
    np.save(root / "code" / "shard_000.npy", np.zeros((40, L + 1), np.float32))
    with pytest.raises(DataError, match="integers"):
        dataset(root, domains=["code"])
    with pytest.raises(RecipeError, match="needs data.path"):
        default_config("dataset", "balanced_shards").build(seq_len=L)


def _hub_cache(cache: Path, root: Path, repo: str = "org/nova-data") -> Path:
    """The Hugging Face cache layout of a dataset repo at one commit (what a download leaves)."""
    base = cache / f"datasets--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = base / "snapshots" / commit / "data"
    for src in root.rglob("*.npy"):
        dst = snap / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    return snap


def test_hub_source_offline_reads_the_cache_like_a_folder(root, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hub_cache(tmp_path / "hf", root)
    cfg = default_config("dataset", "balanced_shards", repo_id="org/nova-data",
                         cache_dir=str(tmp_path / "hf"), local_files_only=True, domains=DOMAINS,
                         eval_rows=4)
    hub = cfg.build(tokenizer=None, seq_len=L, seed=0)
    hub.prepare()
    a = hub.loader("train", micro_batch=3, global_batch=6)
    b = dataset(root).loader("train", micro_batch=3, global_batch=6)
    for _ in range(25):
        assert tags(next(a)) == tags(next(b))
    assert hub.eval_shard["math"] == "math/shard_000.npy"


def test_hub_source_online_lists_the_repo_tree(root, tmp_path, monkeypatch):
    import huggingface_hub

    snap = _hub_cache(tmp_path / "hf", root)
    listed = []

    class Entry:
        def __init__(self, path):
            self.path = path

    def list_repo_tree(self, repo_id, path_in_repo, repo_type, revision, recursive):
        assert (repo_id, repo_type, recursive) == ("org/nova-data", "dataset", False)
        listed.append(path_in_repo)
        folder = snap.parent / path_in_repo
        return [Entry(f"{path_in_repo}/{p.name}") for p in folder.iterdir()]

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", list_repo_tree)
    real = huggingface_hub.hf_hub_download
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **k: real(*a, **{**k, "local_files_only": True}))
    cfg = default_config("dataset", "balanced_shards", repo_id="org/nova-data",
                         cache_dir=str(tmp_path / "hf"), domains=DOMAINS, eval_rows=4)
    hub = cfg.build(tokenizer=None, seq_len=L, seed=0)
    hub.prepare()
    assert listed == ["data/code", "data/math", "data/web"]
    assert tags(next(hub.loader("train", micro_batch=6, global_batch=6))) == tags(
        next(dataset(root).loader("train", micro_batch=6, global_batch=6)))


def test_prefetch_thread_gives_the_same_batches_and_reports_the_consumed_state(root):
    sync = dataset(root, prefetch=0).loader("train", micro_batch=2, global_batch=6)
    ahead = dataset(root, prefetch=4).loader("train", micro_batch=2, global_batch=6)
    for _ in range(23):  # past the first shards (20 rows): the thread reads further
        assert tags(next(ahead)) == tags(next(sync))
    deadline = time.monotonic() + 60  # on a loaded machine the thread may not have run yet
    while ahead._ahead <= ahead._pos and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead._ahead > ahead._pos
    assert ahead.state_dict() == sync.state_dict()
    ahead.skip_steps(2)  # stops the thread, rewinds the streams to what was handed out
    sync.skip_steps(2)
    assert ahead._prefetcher is None and ahead.state_dict() == sync.state_dict()
    assert [tags(next(ahead)) for _ in range(9)] == [tags(next(sync)) for _ in range(9)]
    ahead.close()


def test_prefetch_reads_in_the_background_and_raises_its_errors_in_the_trainer(root):
    import threading

    ds = dataset(root, prefetch=2)
    readers = set()
    fetch = ds.source.fetch

    def spy(name):
        readers.add(threading.current_thread().name)
        return fetch(name)

    ds.source.fetch = spy
    loader = ds.loader("train", micro_batch=3, global_batch=3)
    next(loader)
    assert readers == {"kiln-prefetch"}
    loader.close()
    for d in DOMAINS:  # every shard unreadable from now on
        for f in (root / d).glob("*.npy"):
            f.write_bytes(b"not an array")
    with pytest.raises(DataError, match="not a readable .npy array"):
        next(ds.loader("train", micro_batch=3, global_batch=3))


def test_ids_beyond_the_tokenizers_vocabulary_are_a_data_error(root):
    """With a tokenizer (as the trainer builds it), every row read is checked against its
    vocabulary: the shards above hold ids up to 20,000+, beyond the byte tokenizer's 258."""
    from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer

    cfg = default_config("dataset", "balanced_shards", path=str(root), domains=DOMAINS,
                         eval_rows=4)
    ds = cfg.build(tokenizer=ByteTokenizer(), seq_len=L, seed=0)
    ds.prepare()
    with pytest.raises(DataError, match=r"\w+/shard_00\d.npy: token id \d+ is outside the "
                                        r"vocabulary .* \(258 ids\)"):
        next(iter(ds.loader("eval", micro_batch=3, global_batch=3)))
    loader = ds.loader("train", micro_batch=3, global_batch=3)
    with pytest.raises(DataError, match="kiln data prepare --domain"):
        next(loader)
    loader.close()


def test_rows_carry_documents_from_bos_with_a_tokenizer(root):
    """Shards hold bare ids: a new document starts at each BOS of the dataset's tokenizer (here
    the token 3 + tag of every row's third position); no tokenizer, no ``doc_ids``."""
    from types import SimpleNamespace

    assert "doc_ids" not in next(dataset(root).loader("train", micro_batch=3, global_batch=3))
    cfg = default_config("dataset", "balanced_shards", path=str(root), domains=DOMAINS,
                         eval_rows=4)
    ds = cfg.build(tokenizer=SimpleNamespace(bos_id=int(tag(0, 0, 4)) + 2,
                                          vocab_size=1 << 16), seq_len=L, seed=0)
    ds.prepare()
    batch = next(ds.loader("train", micro_batch=3, global_batch=3))
    ids, docs = batch["input_ids"], batch["doc_ids"]
    want = torch.zeros_like(docs)
    want[ids[:, :1].eq(tag(0, 0, 4)).squeeze(1), 2:] = 1
    assert docs.dtype == torch.int32 and torch.equal(docs, want)


def test_a_malformed_cursor_is_one_data_error(root):
    a = dataset(root).loader("train", micro_batch=2, global_batch=6)
    next(a)
    state = json.loads(json.dumps(a.state_dict()))
    state["streams"]["code"]["entries"][0][1] = "many"
    with pytest.raises(DataError, match=r"streams\.code\.entries\.0\.1: Input should be a valid "
                       "integer"):
        dataset(root).loader("train", micro_batch=2, global_batch=6).check_state_dict(state)
    del state["streams"]["code"]
    with pytest.raises(DataError, match="streams"):
        dataset(root).loader("train", micro_batch=2, global_batch=6).load_state_dict(state)
