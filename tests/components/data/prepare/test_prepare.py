"""The real-corpus builder: formats agree, worker processes agree with in-process encoding,
reruns are no-ops, killed builds continue, shards for balanced_shards, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.components.base import default_config
from kiln.components.data.prepare.packed_layout import open_layout
from kiln.components.data.prepare.prepare import PROGRESS, PrepareOptions, prepare
from kiln.components.errors import DataError
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from tests.components.data.corpora import (
    DOCS,
    write_jsonl,
    write_parquet,
    write_saved_dataset,
)
from tests.components.tokenizers.slow_tokenizer import FailingByteTokenizer
from tests.components.tokenizers.test_hf_tokenizer import fill_cache
from tests.components.tokenizers.tokenizer_files import trained_tokenizer
from tests.conftest import REPO


def _opts(inputs, out, **kw) -> PrepareOptions:
    return PrepareOptions(inputs=[str(i) for i in inputs], out=str(out), seq_len=16,
                          batch_bytes=kw.pop("batch_bytes", 300), **kw)


def _docs(folder: Path, tok) -> list[str]:
    layout = open_layout(folder, tok)
    off = layout.doc_offsets
    return [tok.decode(layout.tokens[off[i]:off[i + 1]]) for i in range(len(off) - 1)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = trained_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")
    return default_config("tokenizer", "huggingface", path=str(folder)).build()


def test_every_format_gives_the_same_documents(tmp_path, bpe):
    sources = {"parquet": write_parquet(tmp_path / "in" / "c.parquet"),
               "jsonl.gz": write_jsonl(tmp_path / "in" / "c.jsonl.gz", compress="gz"),
               "saved": write_saved_dataset(tmp_path / "in" / "saved")}
    tokens = {}
    for name, path in sources.items():
        result = prepare(_opts([path], tmp_path / name), bpe, progress=False, log=lambda s: 0)
        assert result.status == "built" and _docs(result.folder, bpe) == DOCS
        meta = json.loads((result.folder / "metadata.json").read_text())
        assert meta["token_dtype"] == "uint16" and meta["tokenizer_source"] == bpe.source
        assert sum(s["bytes"] for s in meta["splits"].values()) == sum(
            len(d.encode()) for d in DOCS)
        tokens[name] = (result.folder / "tokens.bin").read_bytes()
    assert len(set(tokens.values())) == 1


def test_worker_processes_write_the_same_bytes(tmp_path, bpe):
    src = write_jsonl(tmp_path / "c.jsonl")
    a = prepare(_opts([src], tmp_path / "a", workers=0), bpe, progress=False)
    b = prepare(_opts([src], tmp_path / "b", workers=2), bpe, progress=False)
    for name in ("tokens.bin", "doc_offsets.npy", "epoch_1/doc_start.npy"):
        assert (a.folder / name).read_bytes() == (b.folder / name).read_bytes()


def test_rerun_is_a_no_op_and_changed_inputs_are_refused(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl")
    tok = ByteTokenizer()
    assert prepare(_opts([src], tmp_path / "o"), tok, progress=False).status == "built"
    os.utime(src, ns=(1, 1))  # touched, same content: still up to date (sha256 checked)
    assert prepare(_opts([src], tmp_path / "o"), tok, progress=False).status == "up to date"
    write_jsonl(src, DOCS[::-1])  # same size, other content
    with pytest.raises(DataError, match="built from other inputs.*--overwrite"):
        prepare(_opts([src], tmp_path / "o"), tok, progress=False)
    redo = prepare(_opts([src], tmp_path / "o"), tok, overwrite=True, progress=False)
    assert redo.status == "built" and _docs(redo.folder, tok) == DOCS[::-1]
    with pytest.raises(DataError, match="built from other inputs"):  # other settings
        prepare(_opts([src], tmp_path / "o", seed=3), tok, progress=False)
    assert not list(tmp_path.glob(".o.partial")) + list(tmp_path.glob(".o.old"))


@pytest.mark.parametrize("domain", ["", "code"])
def test_a_crashed_build_continues_where_it_stopped(tmp_path, domain):
    files = [write_jsonl(tmp_path / "in" / f"{i}.jsonl", DOCS[i * 20:(i + 1) * 20])
             for i in range(3)]
    kw = {"domain": domain, "shard_tokens": 400}
    whole = prepare(_opts(files, tmp_path / "whole", **kw), ByteTokenizer(), progress=False)
    logs: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        prepare(_opts(files, tmp_path / "cut", **kw), FailingByteTokenizer(9), progress=False)
    target = tmp_path / "cut" / domain if domain else tmp_path / "cut"
    partial = target.parent / f".{target.name}.partial"
    assert not target.exists() and json.loads((partial / PROGRESS).read_text())["docs"] > 0
    again = prepare(_opts(files, tmp_path / "cut", **kw), ByteTokenizer(), progress=False,
                    log=logs.append)
    assert again.status == "resumed" and "continuing" in logs[0] and not partial.exists()
    names = ["tokens.bin", "doc_offsets.npy"] if not domain else [
        p.name for p in sorted(whole.folder.glob("shard_*.npy"))]
    assert names and all((whole.folder / n).read_bytes() == (again.folder / n).read_bytes()
                         for n in names)
    assert again.manifest["totals"] == whole.manifest["totals"]


def test_a_killed_process_is_continued(tmp_path):
    files = [write_jsonl(tmp_path / "in" / f"{i:02d}.jsonl", DOCS) for i in range(30)]
    out = tmp_path / "out"
    code = (
        "import sys; from tests.components.tokenizers.slow_tokenizer import SlowByteTokenizer as T;"
        "from kiln.components.data.prepare.prepare import PrepareOptions as O, prepare;"
        f"prepare(O(inputs=sys.argv[1:], out={str(out)!r}, seq_len=16, batch_bytes=300), T(),"
        " progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, files)], cwd=REPO)
    progress = tmp_path / ".out.partial" / PROGRESS
    try:
        while proc.poll() is None:
            if progress.exists() and json.loads(progress.read_text())["docs"] >= 120:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    result = prepare(_opts(files, out), ByteTokenizer(), progress=False)
    assert result.status == "resumed"
    assert _docs(out, ByteTokenizer()) == DOCS * 30


def test_domain_shards_feed_balanced_shards(tmp_path):
    for name, docs in (("code", DOCS[:30]), ("math", DOCS[30:])):
        src = write_parquet(tmp_path / f"{name}.parquet", docs)
        r = prepare(_opts([src], tmp_path / "shards", domain=name, shard_tokens=300),
                    ByteTokenizer(), progress=False)
        shards = sorted(r.folder.glob("shard_*.npy"))
        assert len(shards) == r.manifest["totals"]["shards"] > 1
        assert all(len(np.load(s)) >= 300 for s in shards[:-1])
        assert json.loads((r.folder / "shards.json").read_text())["num_docs"] == len(docs)
    cfg = default_config("dataset", "balanced_shards", path=str(tmp_path / "shards"),
                         domains=["code", "math"], eval_rows=2)
    ds = cfg.build(tokenizer=ByteTokenizer(), seq_len=16, seed=0)
    ds.prepare()
    batch = next(iter(ds.loader("train", micro_batch=4, global_batch=4)))
    assert batch["input_ids"].shape == (4, 16) and int(batch["labels"].max()) < 258
    other = default_config("tokenizer", "bpe", max_bytes=100_000, vocab_size=300,
                           cache_dir=str(tmp_path)).build()
    with pytest.raises(DataError, match="shards tokenized by ByteTokenizer.*recipe's tokenizer"):
        cfg.build(tokenizer=other, seq_len=16, seed=0).prepare()


def test_hub_dataset_through_the_offline_cache(tmp_path, offline_cache):
    write_parquet(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet")
    fill_cache(offline_cache, "me/corpus", tmp_path / "repo", kind="datasets")
    r = prepare(_opts(["hf://datasets/me/corpus"], tmp_path / "o"), ByteTokenizer(),
                progress=False)
    assert _docs(r.folder, ByteTokenizer()) == DOCS
    assert r.manifest["inputs"][0]["name"].startswith("hf://datasets/me/corpus@")


def test_bad_input(tmp_path):
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match=r"gave no documents \(empty files: 1"):
        prepare(_opts([tmp_path / "e.txt"], tmp_path / "o"), ByteTokenizer(), progress=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(DataError, match="not built by kiln data prepare"):
        prepare(_opts([write_jsonl(tmp_path / "c.jsonl")], tmp_path / "taken"), ByteTokenizer(),
                progress=False)
    assert (tmp_path / "taken" / "x").read_text() == "mine"
    with pytest.raises(DataError, match="--domain"):
        prepare(_opts([tmp_path / "c.jsonl"], tmp_path / "o", domain="../x"), ByteTokenizer())


class _WideVocab(ByteTokenizer):
    """Byte ids, but a vocabulary past 65,536: the layout must switch to uint32."""

    vocab_size = 70_000

    def fingerprint(self) -> str:
        return "wide-v1"


def test_vocabularies_past_uint16_write_uint32(tmp_path):
    r = prepare(_opts([write_jsonl(tmp_path / "c.jsonl")], tmp_path / "o"), _WideVocab(),
                progress=False)
    meta = json.loads((r.folder / "metadata.json").read_text())
    assert meta["token_dtype"] == "uint32" and _docs(r.folder, _WideVocab()) == DOCS
