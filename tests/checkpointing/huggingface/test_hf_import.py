"""Import of Hugging Face checkpoints: tiny random models from transformers configs, saved
sharded with an index, imported into kiln's transformer: logits within 1e-5; the round trip
kiln -> Hugging Face -> kiln is bit-equal; errors name the tensor or file."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.checkpointing.huggingface import files as hf_files
from kiln.checkpointing.huggingface import importer as hf_import
from kiln.checkpointing.huggingface import layout as hf_layout
from kiln.checkpointing.huggingface.export import export
from kiln.components.errors import CheckpointError
from tests.checkpointing.huggingface.hf_tiny import (
    LLAMA3,
    YARN,
    ids,
    kiln_from_hf,
    kiln_model,
    save_tiny,
)

TOL = dict(rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}),  # GQA: 4 heads, 2 kv heads
    ("llama", {"rope_parameters": LLAMA3}),
    ("llama", {"rope_parameters": YARN}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1, "attention_bias": True}),
    ("mistral", {"sliding_window": 64}),
    ("mistral", {"sliding_window": 5}),  # every layer slides within the 16-token rows
    ("mistral", {"sliding_window": 3}),  # 6 windows a row: banded (attention/banded.py)
    # layer 0 full, layer 1 sliding (max_window_layers), QK-norm
    ("qwen3", {"head_dim": 32, "use_sliding_window": True, "sliding_window": 5,
               "max_window_layers": 1}),
    ("qwen2", {}),  # q/k/v biases, no o bias
    ("qwen3", {"head_dim": 32}),  # QK-norm, heads wider than hidden / n_heads
])
def test_imported_logits_match_transformers(tmp_path, family, overrides):
    hf = save_tiny(tmp_path / "hf", family, **overrides)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert hf_files.INDEX in files and len([f for f in files if f.endswith(".safetensors")]) > 2
    model = kiln_from_hf(tmp_path / "hf")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, **TOL)


def test_round_trip_kiln_hf_kiln_is_bit_equal(tmp_path):
    save_tiny(tmp_path / "hf", "qwen3", rope_parameters=LLAMA3)
    first = kiln_from_hf(tmp_path / "hf")
    summary = export(first, None, tmp_path / "out", model_table={}, recipe_file=None,
                     max_shard_size="50KB")
    assert summary["family"] == "qwen3" and hf_files.INDEX in summary["files"]
    back = kiln_from_hf(tmp_path / "out")
    for (name, a), (_, b) in zip(first.state_dict().items(), back.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"


def test_fused_qkv_rows_are_kv_groups_of_the_hf_projections(tmp_path):
    """A fused wqkv holds its rows per kv head (so tensor parallelism can shard it): importing
    gives transformers' logits, and exporting writes back the very tensors that were read."""
    hf = save_tiny(tmp_path / "hf", "qwen2")  # GQA (4 heads, 2 kv heads), q/k/v biases
    model = kiln_from_hf(tmp_path / "hf", 32, "--model.attention.fused_qkv=true")
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), hf(ids()).logits, **TOL)
    export(model, None, tmp_path / "out", model_table={}, recipe_file=None)
    src, out = hf_files.SafetensorsFolder(tmp_path / "hf"), hf_files.SafetensorsFolder(
        tmp_path / "out")
    assert src.keys() == out.keys()
    for name in sorted(src.keys()):
        assert torch.equal(src.read(name), out.read(name)), name


def test_sliced_reads_equal_full_reads(tmp_path):
    """What an FSDP rank reads (its rows / columns) is that region of the full tensor, also
    when a region starts or ends inside a RoPE head and spans the q / k / v parts of wqkv."""
    save_tiny(tmp_path / "hf", "llama")
    model = kiln_from_hf(tmp_path / "hf", 32, "--model.attention.fused_qkv=true")
    files = hf_files.SafetensorsFolder(tmp_path / "hf")
    parts = hf_layout.parts(model)["layers.1.attention.wqkv.weight"]
    full = model.layers["1"].attention.wqkv.weight  # (64 + 32 + 32, 64)
    for offset, shape in [((0, 0), (128, 64)), ((5, 3), (70, 20)), ((63, 0), (2, 64)),
                          ((100, 60), (28, 4))]:
        region = files.read_rows(parts, offset, shape)
        want = full[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]
        assert torch.equal(region, want), offset


def test_errors_name_the_tensor(tmp_path):
    save_tiny(tmp_path / "hf", "llama")
    config = hf_import.read_config(tmp_path / "hf")
    wide = kiln_model(tmp_path / "hf", 32, "--model.ffn.hidden_dim=128")
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight has shape \[96, 64\]"):
        hf_import.load_weights(wide, tmp_path / "hf", config)
    tied = kiln_model(tmp_path / "hf", 32, "--model.tie_embeddings=true")  # the config: untied
    with pytest.raises(CheckpointError, match="no place for lm_head.weight"):
        hf_import.load_weights(tied, tmp_path / "hf", config)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pickle"):
        hf_files.SafetensorsFolder(tmp_path / "pickled")
    index = json.loads((tmp_path / "hf" / hf_files.INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "hf" / first).unlink()
    with pytest.raises(CheckpointError, match=first):
        hf_files.SafetensorsFolder(tmp_path / "hf")


@pytest.mark.parametrize("family, overrides", [
    ("mistral", {"sliding_window": 5}),
    ("mistral", {"sliding_window": 3}),  # banded, the last band padded
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
])
def test_sliding_window_gradients_match_transformers(tmp_path, family, overrides):
    """The backward through windowed attention: the same gradients on the token embeddings."""
    hf = save_tiny(tmp_path / "hf", family, **overrides)
    model = kiln_from_hf(tmp_path / "hf")
    assert model.blocks()[-1].attention.window == overrides["sliding_window"]
    x = ids()
    (hf(x).logits ** 2).mean().backward()
    (model(x) ** 2).mean().backward()
    torch.testing.assert_close(model.tok_embeddings.weight.grad,
                               hf.model.embed_tokens.weight.grad, rtol=1e-5, atol=1e-7)


def test_validate_checks_the_weights_from_their_headers(tmp_path, capsys):
    """`kiln validate` of an imported recipe runs the weights' checks that training runs first
    (every tensor there, with its shape; the files readable) on the meta model, reading only
    the files' headers; `kiln train` would stop on the same line after the run had started."""
    from kiln.recipes.cli import main
    from kiln.recipes.loading.hf_recipe import import_recipe

    save_tiny(tmp_path / "hf", "llama")
    recipe = tmp_path / "imported.toml"
    import_recipe(str(tmp_path / "hf"), recipe, seq_len=32)
    assert main(["validate", str(recipe), "--no-data"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert main(["validate", str(recipe), "--no-data", "--model.ffn.hidden_dim=128"]) != 0
    assert "mlp.gate_proj.weight has shape [96, 64]" in capsys.readouterr().out
    index = json.loads((tmp_path / "hf" / hf_files.INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "hf" / shard).write_bytes(b"\xff" * 64)  # a damaged download
    assert main(["validate", str(recipe), "--no-data"]) != 0
    assert f"{shard}: cannot read safetensors" in capsys.readouterr().out
