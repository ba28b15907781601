"""Real corpus files written in the test: JSONL (plain, gzip, zstd), parquet, a saved Hugging
Face dataset; the same documents in each so readers can be compared."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

DOCS = [f"document {i}: " + "kiln packs documents. " * (i % 7 + 1) + "é" * (i % 3)
        for i in range(60)]


def jsonl_bytes(docs=DOCS, field: str = "text") -> bytes:
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def write_jsonl(path: Path, docs=DOCS, compress: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = jsonl_bytes(docs)
    if compress == "gz":
        data = gzip.compress(data, mtime=0)
    elif compress == "zst":
        zstandard = pytest.importorskip("zstandard")

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_parquet(path: Path, docs=DOCS, row_group_size: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), "text": list(docs)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_saved_dataset(folder: Path, docs=DOCS, with_test: bool = False) -> Path:
    datasets = pytest.importorskip("datasets")

    train = datasets.Dataset.from_dict({"text": list(docs), "id": list(range(len(docs)))})
    if with_test:
        test = datasets.Dataset.from_dict({"text": ["held out"] * 3, "id": [0, 1, 2]})
        datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    else:
        train.save_to_disk(str(folder))
    return folder
