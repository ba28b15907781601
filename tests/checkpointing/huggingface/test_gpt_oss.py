"""gpt-oss in and out of Hugging Face's layout: `kiln import` of a tiny random
``GptOssForCausalLM`` (q/k/v/o biases, sinks, a window on every other layer, biased experts with
the clamped SwiGLU, a router bias, YaRN) gives its logits; `kiln export` of it loads in
transformers with kiln's logits."""

from __future__ import annotations

import pytest
import torch

from kiln.checkpointing.huggingface import export
from kiln.checkpointing.huggingface.layout import hf_incompatibility
from tests.checkpointing.huggingface.hf_tiny import ids, kiln_from_hf, peft_export_loads

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
              bos_token_id=256, eos_token_id=257,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                               "original_max_position_embeddings": 16, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False})


def _gpt_oss(folder):
    config = transformers.GptOssConfig(**CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # biases, sinks and norms away from their init; clamps in reach
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the logits' scale (the issue's 1e-5 relative; near-zero logits would
    fail a per-element relative test on rounding alone)."""
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_import_gives_transformers_logits_and_export_loads_back(tmp_path):
    hf = _gpt_oss(tmp_path / "hf")
    model = kiln_from_hf(tmp_path / "hf", 32)
    assert hf_incompatibility(model) == ""
    x = ids(t=32)  # 6 windows of 6: the sliding layer runs banded (attention/banded.py)
    with torch.no_grad():
        _close(model(x), hf(x).logits)
        model.blocks()[0].feed_forward.b2.add_(0.1)  # kiln's own weights from here
    summary = export.export(model, None, tmp_path / "out", model_table={}, recipe_file=None)
    assert summary["layout"] == "hf" and summary["family"] == "gpt_oss", summary
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        _close(back(x).logits, model(x))


def test_the_released_configs_extra_fields_import(tmp_path):
    """gpt-oss's released config.json carries experts_per_token and initial_context_length,
    which transformers' code never reads: they import, and change nothing."""
    import json

    hf = _gpt_oss(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.update(experts_per_token=CONFIG["num_experts_per_tok"], initial_context_length=16)
    path.write_text(json.dumps(config))
    model = kiln_from_hf(tmp_path / "hf", 32)
    x = ids(t=12)
    with torch.no_grad():
        _close(model(x), hf(x).logits)


def test_a_peft_export_loads_in_peft_and_an_adapter_on_the_router_is_refused(tmp_path):
    """LoRA on q/k/v/o (biased) and the untied head: peft loads the folder onto the Hugging
    Face base with kiln's logits. gpt-oss's router is transformers' GptOssTopKRouter, not an
    nn.Linear: peft refuses to load an adapter on it, so the export refuses to write one."""
    from kiln.checkpointing.huggingface.peft_export import export_peft
    from kiln.components.base import default_config
    from kiln.components.errors import CheckpointError

    _gpt_oss(tmp_path / "hf")
    theirs, ours = peft_export_loads(kiln_from_hf(tmp_path / "hf", 32), tmp_path / "hf",
                                     tmp_path / "adapter", ["*.attention.*", "output"],
                                     ids(t=16), attn_implementation="eager")
    _close(ours, theirs)
    routed = kiln_from_hf(tmp_path / "hf", 32)
    on_router = default_config("adapter", "lora", rank=2,
                               targets=["*.feed_forward.router"]).build()
    on_router.apply(routed)
    with pytest.raises(CheckpointError, match=r"layers.0.feed_forward.router is "
                       r"model.layers.0.mlp.router, transformers' router module"):
        export_peft(routed, tmp_path / "refused", base=str(tmp_path / "hf"),
                    fields=on_router.peft_config())
