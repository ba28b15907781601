"""How `kiln data prepare` frames documents (BOS/EOS, EOS only, one continuous stream) and
which it holds out: a random share of the documents, the contiguous tail of the text, or named
files."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.components.data.packed_loader import Windows
from kiln.components.data.prepare import splits
from kiln.components.data.prepare.packed_layout import open_layout, split_documents
from kiln.components.errors import DataError
from kiln.recipes.cli import main

BOS, EOS = 256, 257


def test_framing_with_both_eos_only_and_none():
    ids, lengths = np.array([1, 2, 3, 4, 5]), np.array([2, 3])
    assert splits.frame(ids, lengths, BOS, EOS).tolist() == [BOS, 1, 2, EOS, BOS, 3, 4, 5, EOS]
    assert splits.frame(ids, lengths, BOS, EOS, "eos").tolist() == [1, 2, EOS, 3, 4, 5, EOS]
    assert splits.frame(ids, lengths, BOS, EOS, "none").tolist() == [1, 2, 3, 4, 5]
    assert splits.framed_lengths(lengths, "eos").tolist() == [3, 4]
    with pytest.raises(DataError, match="separator 'bar': choose one of bos_eos, eos, none"):
        splits.framing("bar")


def test_the_random_split_is_the_one_kiln_always_made():
    """The default layout (and so the default run's losses) must not move."""
    rng = np.random.default_rng([7, 0, 0])
    perm = rng.permutation(50)
    train, held = split_documents(50, 0.1, 7)
    assert held.tolist() == perm[:5].tolist() and train.tolist() == sorted(perm[5:].tolist())


def test_the_tail_split_cuts_the_text_at_its_last_share_of_tokens():
    lengths = np.array([100, 100, 50])
    nbytes = np.array([100, 100, 50])
    got = splits.split(lengths, nbytes, eval_split="tail", eval_fraction=0.1, seed=0)
    assert got.lengths.tolist() == [100, 100, 25, 25] and got.cut == 3
    assert got.train.tolist() == [0, 1, 2] and got.eval.tolist() == [3]
    assert got.nbytes.sum() == 250
    whole = splits.split(np.array([250]), np.array([250]), eval_split="tail",
                         eval_fraction=0.2, seed=0)
    assert whole.lengths.tolist() == [200, 50] and whole.eval.tolist() == [1]
    on_edge = splits.split(lengths, nbytes, eval_split="tail", eval_fraction=0.2, seed=0)
    assert on_edge.cut == -1 and on_edge.eval.tolist() == [2]  # at a boundary: nothing is cut


def _prepare(tmp_path, *flags):
    out = tmp_path / "data"
    assert main(["data", "prepare", "--out", str(out), "--workers", "0", "--no-progress",
                 "--seq-len", "16", *flags]) == 0
    return open_layout(out)


def test_one_continuous_text_with_a_tail_eval_split(tmp_path, capsys):
    """nanoGPT's Shakespeare: one file, no BOS/EOS, the last 10% of the text held out."""
    text = "".join(f"line {i} of the play\n" for i in range(300))
    (tmp_path / "play.txt").write_text(text)
    layout = _prepare(tmp_path, "--input", str(tmp_path / "play.txt"), "--separator", "none",
                      "--eval-split", "tail", "--eval-fraction", "0.1")
    meta = layout.meta
    assert meta["separator"] == "none" and meta["eval_split"] == "tail"
    assert meta["total_tokens"] == len(text.encode())  # bytes: no BOS or EOS anywhere
    cut = len(text) - round(len(text) * 0.1)
    stream = bytes(np.asarray(layout.tokens).tolist())
    start, length = layout.order("eval", 0)
    assert bytes(stream[int(start[0]):int(start[0] + length.sum())]) == text[cut:].encode()
    windows = Windows(layout, "train", 16)
    first = bytes(windows.read(0, 0, 1)[0].tolist()).decode()
    assert first in text and windows.rows_per_epoch() == (cut - 1) // 16
    capsys.readouterr()


def test_named_files_are_the_eval_split_and_never_trained_on(tmp_path):
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    for i in range(6):
        (train_dir / f"{i}.txt").write_text(f"train document {i} " * 20)
    (tmp_path / "valid.txt").write_text("held out words " * 30)
    layout = _prepare(tmp_path, "--input", str(train_dir), "--eval-input",
                      str(tmp_path / "valid.txt"), "--separator", "eos")
    assert layout.meta["eval_split"] == "files"
    assert layout.meta["splits"]["eval"]["docs"] == 1
    assert layout.meta["splits"]["train"]["docs"] == 6
    start, length = layout.order("eval", 0)
    doc = bytes(np.asarray(layout.tokens[int(start[0]):int(start[0] + length[0])]).tolist()[:-1])
    assert doc.decode() == "held out words " * 30
    assert int(layout.tokens[int(start[0] + length[0]) - 1]) == EOS  # eos: an EOS, no BOS
    assert int(layout.tokens[0]) != BOS


def test_bad_split_or_framing_options_are_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x " * 50)
    args = ["data", "prepare", "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"),
            "--workers", "0", "--no-progress"]
    assert main([*args, "--domain", "web", "--separator", "eos"]) == 1
    assert "--domain writes balanced_shards shards" in capsys.readouterr().err
    assert main([*args, "--eval-split", "tail", "--eval-fraction", "0"]) == 1
    assert "give 0 < fraction < 1 of the" in capsys.readouterr().err
