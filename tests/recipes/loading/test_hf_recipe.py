"""Starting from a pretrained model: `kiln import` writes the recipe (folder and Hub sources,
offline), `checkpoint.init_from` loads the weights into the trainer's model, a resumed run
keeps its own checkpoint, and a bad config is one error naming the field."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kiln.checkpointing.huggingface import hub
from kiln.components.errors import CheckpointError, RecipeError
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.checkpointing.huggingface.hf_tiny import LLAMA3, ids, save_tiny
from tests.checkpointing.huggingface.test_hub import COMMIT, FolderApi, offline_cache  # noqa: F401

TRAIN = ["--training.steps=2", "--training.seq_len=16", "--training.global_batch=2",
         "--training.micro_batch=2", "--data.max_bytes=200000", "--eval.interval=0",
         "--eval.at_end=false", "--run.progress_bar=false", "--run.tensorboard=false"]


def test_a_folder_typed_relative_is_written_absolute(tmp_path, monkeypatch):
    """Paths in a recipe are read from the run's working directory: `kiln import hf` from one
    folder must give a recipe that trains from any other."""
    save_tiny(tmp_path / "hf", "llama")
    monkeypatch.chdir(tmp_path)
    assert main(["import", "hf", "--out", "r.toml", "--seq-len", "16"]) == 0
    monkeypatch.chdir("/")
    recipe = load_recipe(tmp_path / "r.toml")
    assert recipe.checkpoint.init_from == str((tmp_path / "hf").resolve())


def test_import_then_init_from_loads_the_weights(tmp_path, capsys):
    hf = save_tiny(tmp_path / "hf", "llama", rope_parameters=LLAMA3)
    recipe_file = tmp_path / "r.toml"
    assert main(["import", str(tmp_path / "hf"), "--out", str(recipe_file), "--seq-len",
                 "16"]) == 0
    out = capsys.readouterr().out
    assert "llama with dim 64, 2 layers, 4 heads / 2 kv heads, vocabulary 300" in out
    recipe = load_recipe(recipe_file, [*TRAIN, f"--run.folder={tmp_path / 'run'}"])
    assert recipe.checkpoint.init_from == str(tmp_path / "hf")
    assert recipe.model.attention.position.scaling == "llama3"
    text = io.StringIO()
    trainer = Trainer(recipe, out=text)
    trainer._start_from_pretrained()
    assert f"initial weights from {tmp_path / 'hf'} (21 tensors)" in text.getvalue()
    x = ids(t=16)
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(x), hf(x).logits, rtol=0, atol=1e-5)


def test_a_resumed_run_keeps_its_own_weights(tmp_path):
    save_tiny(tmp_path / "hf", "qwen2")
    main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r.toml")])
    args = [*TRAIN, f"--run.folder={tmp_path / 'run'}"]
    first = io.StringIO()
    Trainer(load_recipe(tmp_path / "r.toml", args), out=first).fit()
    assert "initial weights from" in first.getvalue()
    again = io.StringIO()
    Trainer(load_recipe(tmp_path / "r.toml", [*args, "--training.steps=3"]), out=again).fit()
    assert "resumed from" in again.getvalue() and "initial weights" not in again.getvalue()


def test_init_from_notes_deliberate_changes(tmp_path):
    save_tiny(tmp_path / "hf", "llama")
    main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r.toml")])
    recipe = load_recipe(tmp_path / "r.toml", [
        *TRAIN, f"--run.folder={tmp_path / 'run'}", "--model.attention.position.scaling=linear",
        "--model.attention.position.factor=2.0"])
    text = io.StringIO()
    Trainer(recipe, out=text)._start_from_pretrained()
    lines = [line for line in text.getvalue().splitlines() if "init_from differs" in line]
    assert lines == [
        "kiln: note: init_from differs: model.attention.position.factor: 1.0 for config.json, "
        "2.0 in the recipe",
        "kiln: note: init_from differs: model.attention.position.scaling: 'none' for "
        "config.json, 'linear' in the recipe"]
    assert "initial weights from" in text.getvalue()  # a context extension loads as asked


def test_bad_config_is_one_error_naming_the_field(tmp_path, capsys):
    save_tiny(tmp_path / "hf", "llama")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    status = main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r.toml")])
    assert status == CheckpointError.exit_code
    err = capsys.readouterr().err
    assert "config.json field 'hidden_act': 'gelu' is not supported" in err
    assert "Traceback" not in err and not (tmp_path / "r.toml").exists()
    assert main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r.toml")]) != 0
    assert "no config.json there" in capsys.readouterr().err


def test_out_is_a_new_file_or_forced(tmp_path, capsys):
    """A folder as --out raised a bare IsADirectoryError; an existing recipe was replaced."""
    save_tiny(tmp_path / "hf", "llama")
    (tmp_path / "mine.toml").write_text("# the user's recipe\n")
    source = str(tmp_path / "hf")
    assert main(["import", source, "--out", str(tmp_path)]) == RecipeError.exit_code
    err = capsys.readouterr().err
    assert f"--out {tmp_path}: is a folder; give the recipe file to write" in err
    assert "Traceback" not in err
    assert main(["import", source, "--out", str(tmp_path / "mine.toml")]) != 0
    assert "the file exists; give a new path, or pass --force" in capsys.readouterr().err
    assert (tmp_path / "mine.toml").read_text() == "# the user's recipe\n"
    assert main(["import", source, "--out", str(tmp_path / "mine.toml"), "--force"]) == 0
    assert "init_from" in (tmp_path / "mine.toml").read_text()


def test_init_from_notes_no_difference_where_there_is_none(tmp_path):
    """A recipe that trains the imported model with a document mask and per-document positions
    (how training feeds attention: a config.json has no such key) and writes its kv heads as 0
    (= n_heads, the config's 4): no note, where each used to print one."""
    save_tiny(tmp_path / "hf", "llama", num_key_value_heads=4)
    main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r.toml")])
    recipe = load_recipe(tmp_path / "r.toml", [
        *TRAIN, f"--run.folder={tmp_path / 'run'}", "--model.attention.n_kv_heads=0",
        "--model.attention.document_mask=true", "--model.attention.positions=per_document"])
    text = io.StringIO()
    Trainer(recipe, out=text)._start_from_pretrained()
    assert "init_from differs" not in text.getvalue(), text.getvalue()
    assert "initial weights from" in text.getvalue()


def test_without_a_tokenizer_the_note_says_whether_the_byte_fallback_fits(tmp_path, capsys):
    """No tokenizer.json: the recipe falls back to the byte tokenizer (258 ids); the note says
    so, and where the model's vocabulary is smaller says that the recipe cannot train as it
    is (validate would refuse it)."""
    for vocab, fits in ((300, True), (200, False)):
        save_tiny(tmp_path / str(vocab), "llama", vocab_size=vocab)
        out = tmp_path / f"{vocab}.toml"
        assert main(["import", str(tmp_path / str(vocab)), "--out", str(out)]) == 0
        err = "".join(capsys.readouterr())
        assert ("ids 0-257 of the model's vocabulary" in err) == fits, err
        assert ("its vocabulary (200) is smaller than the byte tokenizer's (258)" in err) \
            == (not fits), err
        assert load_recipe(out).tokenizer.type == "byte"


def test_hub_source_through_an_offline_cache(tmp_path, offline_cache, capsys):  # noqa: F811
    from tests.components.tokenizers.tokenizer_files import trained_tokenizer

    save_tiny(tmp_path / "hf", "qwen3", vocab_size=448, bos_token_id=0, eos_token_id=1)
    trained_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((tmp_path / "tok" / name).read_bytes())
    api = FolderApi(offline_cache)
    api.create_repo("me/tiny")
    api.upload_folder(repo_id="me/tiny", folder_path=str(tmp_path / "hf"), path_in_repo=".")
    for spec in ("hf://me/tiny", "hf://me/tiny@main", f"hf://me/tiny@{COMMIT}"):
        assert main(["import", spec, "--out", str(tmp_path / "r.toml"), "--force"]) == 0, \
            capsys.readouterr().err
        recipe = load_recipe(tmp_path / "r.toml", [*TRAIN, f"--run.folder={tmp_path / 'run'}"])
        assert recipe.checkpoint.init_from == spec and recipe.model.attention.qk_norm
        assert (recipe.tokenizer.type, recipe.tokenizer.path) == ("huggingface", spec)
        assert recipe.tokenizer.build().vocab_size == 400  # from the cache, offline
    text = io.StringIO()
    Trainer(recipe, out=text)._start_from_pretrained()
    assert f"initial weights from hf://me/tiny@{COMMIT}" in text.getvalue()
    with pytest.raises(CheckpointError, match="cannot fetch"):
        hub.download_model("hf://me/absent")


def test_the_tokenizer_travels_from_import_through_training_to_the_export(tmp_path, capsys):
    """A source with a tokenizer.json: the recipe trains with it (config.json's BOS/EOS pinned
    where its tokenizer config names others), the export carries it, and transformers loads
    tokenizer and model back with kiln's ids and logits."""
    import transformers  # a dev dependency (pyproject.toml): this test never skips

    from tests.components.tokenizers.tokenizer_files import trained_tokenizer

    # the test tokenizer: 400 ids, BOS <|bos|> = 0, EOS <|eos|> = 1, pad 2; config.json says
    # EOS is 2: the recipe pins it
    save_tiny(tmp_path / "hf", "llama", vocab_size=448, bos_token_id=0, eos_token_id=2)
    trained_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((tmp_path / "tok" / name).read_bytes())
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r.toml")]) == 0
    assert "tokenizer huggingface" in capsys.readouterr().out
    recipe = load_recipe(tmp_path / "r.toml", [*TRAIN, f"--run.folder={tmp_path / 'run'}"])
    tok = recipe.tokenizer
    assert (tok.type, tok.path, tok.bos_token, tok.eos_token) == (
        "huggingface", str(tmp_path / "hf"), "", "<|pad|>")
    trainer = Trainer(recipe, out=io.StringIO())
    trainer.fit()
    assert (trainer.tokenizer.vocab_size, trainer.tokenizer.eos_id) == (400, 2)
    assert trainer.model.vocab_size == 448  # the checkpoint's, not the tokenizer's padded
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "import os\nprint(os.getcwd())\n"
    ids_ = trainer.tokenizer.encode(text)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids_[1:]
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 2)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.tensor([ids_[:16]])  # the model's context is training.seq_len here
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, trainer.model.eval()(x), rtol=0, atol=1e-5)
