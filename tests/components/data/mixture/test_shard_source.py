"""A ``balanced_shards`` dataset as a mixture source (``components/data/shard_rows.py``): its
rows by number, each train row once per pass, eval rows held out, and inside a mixture the same
global batches on any layout and an exact resume."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch

from kiln.components.base import default_config
from kiln.components.errors import DataError
from kiln.recipes.config.files import load_recipe
from tests.components.data.mixture.test_dataset import _steps

L = 16  # seq_len
DOMAINS = ["code", "math"]


def _shards(root, rows=(12, 7), shards=2):
    """Rows [domain*100 + shard*10 + 50 (< 256: byte ids), row, 0, 1, 2, ...]."""
    for d, name in enumerate(DOMAINS):
        (root / name).mkdir(parents=True, exist_ok=True)
        for s in range(shards):
            arr = np.array([[d * 100 + s * 10 + 50, r, *range(L - 1)]
                            for r in range(rows[d])], np.uint16)
            np.save(root / name / f"shard_{s:03d}.npy", arr)
    return root


def _ids(rows: np.ndarray) -> list[tuple[int, int]]:
    return [(int(r[0]), int(r[1])) for r in rows]


def _shard_rows(tmp_path, split, **values):
    cfg = default_config("dataset", "balanced_shards", path=str(_shards(tmp_path / "shards")),
                         domains=DOMAINS, eval_rows=3, **values)
    ds = cfg.build(tokenizer=None, seq_len=L, seed=0)
    ds.prepare()
    return ds.rows(split)


def test_each_train_row_comes_once_a_pass_and_eval_rows_never(tmp_path):
    reader = _shard_rows(tmp_path, "train")
    # code: 2 shards x 12 rows, one of them minus 3 eval rows = 21; math: 14 - 3 = 11
    assert reader.rows_per_epoch() == 2 * 11
    rows = np.concatenate([reader.read_rows(e, np.arange(22))[0] for e in range(4)])  # 44 code rows
    code = _ids(rows[0::2])  # row j is domain j % 2
    math = _ids(rows[1::2])
    assert len(set(code[:21])) == 21 and len(set(math[:11])) == 11  # a pass: each row once
    assert sorted(code[:21]) == sorted(code[21:42])  # the next pass: the same rows again
    assert code[:21] != code[21:42]  # ... in another order
    evals = set(_ids(_shard_rows(tmp_path / "e", "eval").read_rows(0, np.arange(6))[0]))
    assert len(evals) == 6 and not evals & set(code + math)
    # numbered reads agree with reads of a run of rows, in any order
    again = reader.read_rows(1, np.array([5, 0, 3]))[0]
    assert np.array_equal(again, rows[[22 + 5, 22, 22 + 3]])
    assert np.array_equal(reader.read_documents(1, 0, 4)[0], rows[22:26])


def test_unshuffled_rows_are_in_shard_and_file_order(tmp_path):
    reader = _shard_rows(tmp_path, "train", shuffle=False)
    code = _ids(reader.read_rows(0, np.arange(0, 22, 2))[0])
    assert code[:9] == [(50, r) for r in range(3, 12)]  # shard 0 minus its 3 eval rows


def _mixture_recipe(tmp_path, overrides=()):
    text = tmp_path / "text"
    text.mkdir()
    for i in range(30):
        (text / f"{i:03d}.txt").write_text(" ".join(["zzz"] * 40))
    path = tmp_path / "mix.toml"
    path.write_text(textwrap.dedent(f"""\
        [training]
        seq_len = {L}
        steps = 20
        [data]
        type = "mixture"
        weights = {{text = 0.5, shards = 0.5}}
        [[data.stages]]
        step = 6
        weights = {{shards = 3, text = 1}}
        [data.sources.text]
        type = "packed_documents"
        source = "folder"
        source_path = "{text}"
        [data.sources.shards]
        type = "balanced_shards"
        path = "{_shards(tmp_path / 'shards')}"
        domains = {json.dumps(DOMAINS)}
        eval_rows = 3
        """))
    recipe = load_recipe(path, list(overrides))
    ds = recipe.data.build(tokenizer=recipe.tokenizer.build(), seq_len=L, seed=0)
    ds.prepare()
    ds.check_run(20, 8)
    return ds


def test_a_shards_source_in_a_mixture_is_exact_on_any_layout_and_on_resume(tmp_path):
    ds = _mixture_recipe(tmp_path)
    full = _steps(ds.loader("train", micro_batch=8, global_batch=8), 12)
    shards = ds.names.index("shards")
    tags = torch.tensor([50, 60, 150, 160])
    for b in full:  # a shards row starts with its tag, a text row with BOS, "zzz" or a space
        assert torch.equal(b["source_ids"] == shards, torch.isin(b["input_ids"][:, 0], tags))
    ranks = [_steps(ds.loader("train", micro_batch=2, global_batch=8, rank=r, world_size=2), 12)
             for r in range(2)]
    for g in range(12):
        assert torch.equal(full[g]["input_ids"], torch.cat([r[g]["input_ids"] for r in ranks]))
    cut = ds.loader("train", micro_batch=4, global_batch=8)
    _steps(cut, 5)  # one step before the stage switch
    resumed = ds.loader("train", micro_batch=8, global_batch=8)
    resumed.load_state_dict(json.loads(json.dumps(cut.state_dict())))
    for g, b in enumerate(_steps(resumed, 7), start=5):
        assert torch.equal(b["input_ids"], full[g]["input_ids"]), g
    held_out = next(iter(ds.loader("eval", micro_batch=2, global_batch=2, source="shards")))
    assert held_out["input_ids"].shape == (2, L)


def test_a_shard_with_ids_outside_the_tokenizer_names_the_shard(tmp_path):
    ds = _mixture_recipe(tmp_path)
    bad = np.full((12, L + 2), 900, np.uint16)  # byte tokenizer: ids below 258
    np.save(tmp_path / "shards" / "code" / "shard_001.npy", bad)
    loader = ds.loader("train", micro_batch=8, global_batch=8)
    with pytest.raises(DataError, match=r"shards/code/shard_001.npy: token id 900 is outside"):
        _steps(loader, 12)
