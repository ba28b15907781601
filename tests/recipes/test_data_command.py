from __future__ import annotations

import json

import pytest

from kiln.recipes.cli import main


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(12):
        (folder / f"{i:02d}.txt").write_text(f"text number {i}\n" * (i + 3))
    (folder / "more.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    return folder


def test_prepare_from_a_folder_then_reuse(tmp_path, texts, capsys):
    out = tmp_path / "data"
    args = ["data", "prepare", "--input", str(texts), "--out", str(out), "--seed", "5"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    meta = json.loads((out / "metadata.json").read_text())
    assert "built in" in printed and str(out) in printed
    assert f"train on it: ./run_train.sh train_configs/debug.toml --data.path={out}\n" in printed
    assert f"{meta['total_tokens']:,} tokens in 13 documents" in printed
    assert meta["seed"] == 5 and meta["source"].startswith("folder:")
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("reused")
    assert main(["data", "info", str(out)]) == 0
    assert "valid packed-document layout" in capsys.readouterr().out


def test_prepare_default_goes_to_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    assert main(["data", "prepare", "--max-bytes", "30000", "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "cache" / "packed" / "stdlib-") in printed
    assert "train on it: ./run_train.sh train_configs/debug.toml --data.path=" in printed
    assert "windows of 64" in printed


def test_prepare_from_a_recipe_with_overrides(tmp_path, texts, write, capsys):
    recipe = write("r.toml", f"""
        [training]
        seq_len = 16
        seed = 7

        [data]
        type = "packed_documents"
        source = "folder"
        source_path = "{texts}"
    """)
    out = tmp_path / "from_recipe"
    assert main(["data", "prepare", str(recipe), "--out", str(out),
                 "--data.num_epochs=2"]) == 0
    hint = f"train on it: ./run_train.sh {recipe} --data.num_epochs=2 --data.path={out}"
    assert hint in capsys.readouterr().out
    meta = json.loads((out / "metadata.json").read_text())
    assert (meta["seed"], meta["seq_len"], meta["num_epochs"]) == (7, 16, 2)


def test_corrupt_folder_exits_1(tmp_path, texts, capsys):
    out = tmp_path / "data"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out)]) == 0
    (out / "tokens.bin").write_bytes(b"\0\0")
    capsys.readouterr()
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "tokens.bin" in err and "kiln data prepare" in err and str(out) in err
    assert main(["data", "info", str(tmp_path / "missing")]) == 1


def test_bad_options_exit_2(texts, capsys):
    assert main(["data", "prepare", "--max-bytes", "0"]) == 2
    assert "max_bytes" in capsys.readouterr().err
    assert main(["data", "prepare", "--data.max_bytes=10"]) == 2
    assert "need a RECIPE" in capsys.readouterr().err
