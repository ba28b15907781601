"""`kiln export`: consolidated safetensors, config.json, recipe.toml; the Llama layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.checkpointing.huggingface.layout import hf_incompatibility
from kiln.checkpointing.huggingface.parts import to_hf as rope_permute
from kiln.checkpointing.manager import CheckpointManager
from kiln.components.distributed import World
from kiln.components.errors import CheckpointError
from kiln.components.models.block import padded_vocab
from kiln.components.positions.rope import RoPE, RoPEConfig
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe, render_recipe
from kiln.recipes.inference.saved_model import export_checkpoint as export
from kiln.recipes.loading.checkpoint_model import load_model
from tests.checkpointing.toy import ToyState
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.ffn.hidden_dim=48", "--training.seq_len=16"]


def checkpoint(tmp_path, *overrides, tiny=TINY):
    recipe = load_recipe(CONFIGS / "debug.toml", [*tiny, *overrides])
    torch.manual_seed(0)
    # the byte tokenizer's 258 ids, padded as every build site pads them (load_model does)
    model = recipe.model.build(vocab_size=padded_vocab(recipe.model, 258), seq_len=16)
    state = ToyState(model=model, optimizers={"main": torch.optim.AdamW(model.parameters())},
                     recipe_toml=render_recipe(recipe))
    state.train_loader = None
    state.progress.step = 5
    CheckpointManager(tmp_path / "ck", World(0, 1, 0, torch.device("cpu")),
                      log=lambda s: None).save(state)
    return tmp_path / "ck" / "step_0000005", model


def test_kiln_layout_round_trips_the_weights(tmp_path):
    folder, model = checkpoint(tmp_path, "--model.layerscale_init=0.1")
    summary = export(folder, tmp_path / "out")
    assert summary["layout"] == "kiln" and summary["why_not_hf"] == "LayerScale"
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "kiln_source.json",
                                                    "model.safetensors", "recipe.toml",
                                                    "tokenizer.json", "tokenizer_config.json"]
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    sd = model.state_dict()
    assert "output.weight" not in tensors  # tied to tok_embeddings: stored once
    assert all(torch.equal(tensors[k], sd[k]) for k in tensors)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["format"] == "kiln" and config["model"]["layerscale_init"] == 0.1
    with pytest.raises(CheckpointError, match="LayerScale"):
        export(folder, tmp_path / "hf", fmt="hf")


def test_exported_and_checkpoint_files_share_one_file_mode(tmp_path):
    """safetensors writes its files 0600; kiln gives them the mode of every other file."""
    folder, _ = checkpoint(tmp_path)
    export(folder, tmp_path / "out")
    for where in (tmp_path / "out", folder):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in where.iterdir() if p.is_file()}
        assert len(set(modes.values())) == 1, modes
    (tmp_path / "plain").mkdir()  # folders follow the umask like any other output (not 0700)
    mode = oct((tmp_path / "plain").stat().st_mode & 0o777)
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "out", folder)} == {mode}


def test_llama_layout_names_and_config(tmp_path):
    folder, model = checkpoint(tmp_path, "--model.attention.n_kv_heads=2",
                               "--model.tie_embeddings=false")
    assert hf_incompatibility(model) == ""
    assert main(["export", str(folder.parent), str(tmp_path / "hf")]) == 0
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert len(tensors) == 2 + 2 * 9 + 1
    assert torch.equal(tensors["lm_head.weight"], model.output.weight)
    assert torch.equal(tensors["model.layers.1.mlp.gate_proj.weight"],
                       model.layers["1"].feed_forward.w1.weight)
    wk = model.layers["0"].attention.wk.weight  # (2 heads * 8, 32)
    assert torch.equal(tensors["model.layers.0.self_attn.k_proj.weight"], rope_permute(wk, 2))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 48 and config["tie_word_embeddings"] is False
    assert config["head_dim"] == 8 and config["rope_theta"] == 10000.0


def _hf_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's rotate-half RoPE on (B, T, H, D), written out from its definition."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)[None, :, None, :]  # (1, T, 1, D)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return (x.double() * ang.cos() + rot.double() * ang.sin()).float()


def test_rope_permutation_maps_kiln_rotation_to_hugging_faces():
    torch.manual_seed(0)
    h, d, dim = 3, 8, 12
    w = torch.randn(h * d, dim)
    x = torch.randn(2, 5, dim)
    rope = RoPE(RoPEConfig(type="rope"), head_dim=d, max_seq_len=5)
    q_kiln, _ = rope((x @ w.T).view(2, 5, h, d), (x @ w.T).view(2, 5, h, d))
    q_hf = _hf_rope((x @ rope_permute(w, h).T).view(2, 5, h, d), 10000.0)
    # same rotation, features reordered within each head: compare dot products
    scores_kiln = torch.einsum("bthd,bshd->bhts", q_kiln, q_kiln)
    scores_hf = torch.einsum("bthd,bshd->bhts", q_hf, q_hf)
    torch.testing.assert_close(scores_kiln, scores_hf, rtol=1e-5, atol=1e-5)


LLAMA3 = ["--model.attention.position.scaling=llama3", "--model.attention.position.factor=8.0",
          "--model.attention.position.original_max_seq_len=8"]


@pytest.mark.parametrize("family, extra", [
    ("llama", ["--model.attention.n_kv_heads=2"]),
    ("llama", ["--model.tie_embeddings=false", "--model.attention.bias=true"]),
    ("llama", ["--model.attention.n_kv_heads=2", *LLAMA3]),
    ("qwen2", ["--model.attention.n_kv_heads=2", "--model.attention.qkv_bias=true",
               "--model.attention.position.scaling=yarn", "--model.attention.position.factor=4.0",
               "--model.attention.position.original_max_seq_len=8"]),
    ("qwen3", ["--model.attention.n_kv_heads=2", "--model.attention.qk_norm=true",
               "--model.attention.head_dim=16", *LLAMA3]),
    ("mistral", ["--model.attention.n_kv_heads=2", "--model.attention.window=5"]),
    ("qwen3", ["--model.attention.qk_norm=true", "--model.attention.window=4",
               '--model.layer_types=["sliding","full"]']),
], ids=["gqa_tied", "untied_bias", "llama3_rope", "qwen2_yarn", "qwen3", "mistral_window",
        "qwen3_layer_types"])
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, family, extra):
    import transformers  # a dev dependency (pyproject.toml): this test never skips

    folder, _ = checkpoint(tmp_path, *extra)
    assert export(folder, tmp_path / "hf")["family"] == family
    _, _, model = load_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           dtype=torch.float32).eval()
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # README: logits within 1e-6 (absolute, fp32); measured 1.2e-7 on this toy model
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), rtol=0, atol=1e-6)


def test_sharded_export_with_index_and_generation_config(tmp_path):
    import transformers  # a dev dependency (pyproject.toml): this test never skips

    folder, _ = checkpoint(tmp_path, "--model.attention.qk_norm=true",
                           "--model.attention.qk_norm_eps=1e-5")
    assert main(["export", str(folder), str(tmp_path / "hf"), "--max-shard-size", "20KB",
                 "--dtype", "bfloat16"]) == 0
    files = sorted(os.listdir(tmp_path / "hf"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    stored = {k: v for f in shards for k, v in load_file(tmp_path / "hf" / f).items()}
    assert set(stored) == set(index["weight_map"])
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in stored.values())
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 256, "eos_token_id": 257}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["dtype"] == "bfloat16"
    _, _, model = load_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           dtype=torch.float32).eval()
    x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # bf16 weights: bf16-sized differences
        torch.testing.assert_close(hf(x).logits, model.eval()(x), rtol=0, atol=0.05)


def test_export_refuses_a_non_empty_folder_and_never_deletes_what_it_did_not_write(tmp_path):
    """Issue 10 item 6: `kiln export runs/r/checkpoints/final runs/r` deleted the whole run."""
    folder, _ = checkpoint(tmp_path)  # tmp_path/ck/step_0000005: the "run" is tmp_path
    (tmp_path / "notes.txt").write_text("mine")
    bystander = tmp_path / ".out.tmp-export"  # a name an earlier version used for its temp
    bystander.mkdir()
    (bystander / "keep").write_text("mine too")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["export", str(folder), str(tmp_path)]) == 2
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert main(["export", str(folder), str(tmp_path), "--force"]) == 0
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert set(after) - set(before) == {Path("config.json"), Path("generation_config.json"),
                                        Path("kiln_source.json"),  # the run it came from
                                        Path("model.safetensors"), Path("recipe.toml"),
                                        Path("tokenizer.json"), Path("tokenizer_config.json")}
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (bystander / "keep").read_text() == "mine too"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".kiln-export")]
    empty = tmp_path / "empty"
    empty.mkdir()
    export(folder, empty)  # an empty folder is fine without --force
    assert sorted(os.listdir(empty)) == ["config.json", "generation_config.json",
                                         "kiln_source.json", "model.safetensors", "recipe.toml",
                                         "tokenizer.json", "tokenizer_config.json"]
