"""Tiny random Hugging Face models built from a transformers config in the test (no download),
saved with a small max_shard_size so the folder has several files and an index."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=256, eos_token_id=257)
CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 10000.0}


def tiny_hf(family: str = "llama", seed: int = 0, **overrides):
    """A random ``<Family>ForCausalLM`` in fp32, eval mode. Its weights are perturbed after the
    init so that norms and biases are not all ones / zeros (the mapping of each one matters)."""
    transformers = pytest.importorskip("transformers")
    name = CLASSES[family]
    config = getattr(transformers, f"{name}Config")(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save_tiny(folder: Path, family: str = "llama", seed: int = 0, **overrides):
    model = tiny_hf(family, seed, **overrides)
    model.save_pretrained(folder, max_shard_size="60KB")
    return model


def ids(n: int = 2, t: int = 16, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def kiln_model(folder: Path, seq_len: int = 32, *overrides: str):
    """The kiln model of `kiln import FOLDER`'s recipe (random weights, on the CPU)."""
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.loading.hf_recipe import import_recipe

    recipe_path = Path(folder).with_suffix(".toml")
    import_recipe(str(folder), recipe_path, seq_len=seq_len)
    recipe = load_recipe(recipe_path, list(overrides))
    return recipe.model.build(vocab_size=258, seq_len=recipe.training.seq_len).eval()


def kiln_from_hf(folder: Path, seq_len: int = 32, *overrides: str):
    """The kiln model `kiln import` + init_from give for a Hugging Face folder."""
    from kiln.checkpointing.huggingface import importer as hf_import

    model = kiln_model(folder, seq_len, *overrides)
    hf_import.load_weights(model, Path(folder), hf_import.read_config(Path(folder)))
    return model


def export_loads_back(model, out: Path, x: torch.Tensor) -> dict:
    """``kiln export`` of ``model`` into ``out`` in Hugging Face's layout; transformers loads it
    with the model's logits on ``x``. Returns the export's summary."""
    transformers = pytest.importorskip("transformers")
    from kiln.checkpointing.huggingface import export

    summary = export.export(model, None, out, model_table={}, recipe_file=None)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), rtol=0, atol=1e-5)
    return summary


def peft_export_loads(model, hf_folder: Path, out: Path, targets: list[str], x: torch.Tensor,
                      **from_pretrained) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA (rank 2) on ``targets`` of ``model`` with a random ``B``, exported with
    ``--format peft`` into ``out``; (peft's logits on the Hugging Face base at ``hf_folder``,
    the kiln model's) on ``x``, for the caller's tolerance."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from kiln.checkpointing.huggingface.peft_export import export_peft
    from kiln.components.base import default_config

    adapter = default_config("adapter", "lora", rank=2, alpha=4, targets=targets).build()
    adapter.apply(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora.B"):
                p.copy_(torch.randn_like(p) * 0.1)
    export_peft(model, out, base=str(hf_folder), fields=adapter.peft_config())
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32,
                                                             **from_pretrained)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        return loaded(x).logits, model(x)
