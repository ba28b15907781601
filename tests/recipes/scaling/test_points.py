"""A ladder's points from a CSV or from run folders, and the messages for what cannot be a
point."""

from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.loading.meta_model import build_meta_model
from kiln.recipes.runs.read import open_run
from kiln.recipes.scaling.points import read_ladder
from tests.recipes.run_folders import make_run


def test_csv_rows_with_and_without_flops(tmp_path):
    path = tmp_path / "ladder.csv"
    path.write_text("label,params,tokens,loss,flops\n a ,1e6,2e7,3.5,\nb,2e6,4e7,3.1,7e14\n")
    ladder = read_ladder(path)
    a, b = ladder.points
    assert (a.label, a.params, a.tokens, a.loss, a.flops) == ("a", 1e6, 2e7, 3.5, 6 * 1e6 * 2e7)
    assert b.flops == 7e14 and ladder.name == str(path)


@pytest.mark.parametrize("text, message", [
    ("params,tokens\n1,2\n", "missing loss"),
    ("params,tokens,loss\n", "no rows"),
    ("params,tokens,loss\n1e6,2e7,3.5\n1e7,lots,3.0\n", r"line 3: tokens = 'lots' is not a"),
])
def test_csv_errors_name_the_line_and_column(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(RecipeError, match=message):
        read_ladder(path)


def test_run_folders_give_params_tokens_flops_and_loss(tmp_path):
    small = make_run(tmp_path / "ladder" / "s1", ("--training.steps=30",), evals=(2.6, 2.4))
    make_run(tmp_path / "ladder" / "s2", ("--training.steps=30", "--model.n_layers=6"),
             evals=(2.2,))
    ladder = read_ladder(tmp_path / "ladder")
    one, two = ladder.points  # smallest first
    model = build_meta_model(open_run(small).recipe)
    seq_len = open_run(small).recipe.training.seq_len
    assert one.params == model.num_params(exclude_embeddings=True) < two.params
    assert one.tokens == 2048 * 30 and one.loss == 2.4 and two.loss == 2.2
    assert one.flops == model.flops_per_token(seq_len) * one.tokens
    total = read_ladder(tmp_path / "ladder", params="total").points[0].params
    assert total == model.num_params()
    train = read_ladder(tmp_path / "ladder", loss="train").points[0].loss
    assert train == 2.0  # the mean over the last tenth of the logged steps: the last line


def test_runs_that_cannot_be_points_are_named(tmp_path):
    make_run(tmp_path / "unfinished" / "s1", ("--training.steps=300",))
    with pytest.raises(RecipeError, match="s1: unfinished .last logged step 30 of 300"):
        read_ladder(tmp_path / "unfinished")
    make_run(tmp_path / "diverged" / "s1", ("--training.steps=30",), evals=(float("nan"),))
    with pytest.raises(RecipeError, match="s1: its eval loss is nan"):
        read_ladder(tmp_path / "diverged")
    make_run(tmp_path / "no_eval" / "s1", ("--training.steps=30",), evals=())
    with pytest.raises(RecipeError, match="no eval/loss logged.*--loss train"):
        read_ladder(tmp_path / "no_eval")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="no run folders inside"):
        read_ladder(tmp_path / "empty")
    with pytest.raises(RecipeError, match="no such file or folder"):
        read_ladder(tmp_path / "nope")
    (tmp_path / "x.txt").write_text("1,2,3")
    with pytest.raises(RecipeError, match="a ladder is a CSV"):
        read_ladder(tmp_path / "x.txt")
