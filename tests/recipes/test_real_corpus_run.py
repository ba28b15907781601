"""End to end on a real corpus: a BPE trained in the test, a parquet file prepared with it, a
short run whose eval reports bits per byte, `kiln eval` printing it, and the tokenizer pairing
check refusing a run with another tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from kiln.components.errors import DataError
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.components.data.corpora import write_parquet
from tests.components.tokenizers.tokenizer_files import stdlib_texts, trained_tokenizer
from tests.conftest import CONFIGS
from tests.recipes.training.test_trainer import TINY


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    tok = trained_tokenizer(root / "tok", vocab_size=400)
    src = write_parquet(root / "c.parquet", list(stdlib_texts()))
    assert main(["data", "prepare", "--input", str(src), "--out", str(root / "data"),
                 "--tokenizer", str(tok), "--workers", "0", "--no-progress",
                 "--eval-fraction", "0.2"]) == 0
    return root, tok


def _overrides(root, tok, name):
    return [*[o for o in TINY if not o.startswith(("--data.max_bytes", "--data.eval_fraction",
                                                    "--checkpoint"))],
            "--data.path=" + str(root / "data"), "--tokenizer.type=huggingface",
            f"--tokenizer.path={tok}", f"--run.folder={root / name}", "--checkpoint.interval=4"]


def test_a_run_on_prepared_bpe_data_reports_bpb(prepared, capsys):
    root, tok = prepared
    recipe = load_recipe(CONFIGS / "debug.toml", _overrides(root, tok, "run"))
    with open(os.devnull, "w") as sink:
        trainer = Trainer(recipe, out=sink)
        trainer.fit()
    assert trainer.model.vocab_size == 448 and trainer.tokenizer.vocab_size == 400
    logged = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in logged if "eval/bpb" in e]
    meta = json.loads((root / "data" / "metadata.json").read_text())["splits"]["eval"]
    assert evals and evals[-1]["eval/bpb"] == pytest.approx(
        evals[-1]["eval/loss"] * meta["tokens"] / meta["bytes"] / 0.6931471805599453)
    capsys.readouterr()
    assert main(["eval", str(root / "run"), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["bpb"] == pytest.approx(row["loss"] * meta["tokens"] / meta["bytes"] / 0.693147,
                                       rel=1e-5)
    assert main(["eval", str(root / "run")]) == 0
    assert "bpb" in capsys.readouterr().out.splitlines()[1]


def test_training_with_another_tokenizer_is_refused(prepared):
    root, tok = prepared
    overrides = [o for o in _overrides(root, tok, "x") if not o.startswith("--tokenizer")]
    recipe = load_recipe(CONFIGS / "debug.toml", overrides)
    with open(os.devnull, "w") as sink, pytest.raises(
            DataError, match=rf"tokenized by {tok} .* recipe's tokenizer is ByteTokenizer"):
        Trainer(recipe, out=sink)
