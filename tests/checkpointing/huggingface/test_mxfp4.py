"""gpt-oss's released form: the experts' matrices in MXFP4 (``_blocks`` of 4-bit e2m1 pairs and
``_scales`` of e8m0 exponents per 32 inputs). kiln's dequantization equals transformers'
(``convert_moe_packed_tensors``) bit for bit, and importing the quantized checkpoint equals
importing its dequantized weights; a rank's read of some experts and columns equals that
region of the whole."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpointing.huggingface import mxfp4
from kiln.checkpointing.huggingface.files import SafetensorsFolder
from tests.checkpointing.huggingface.hf_tiny import ids, kiln_from_hf

transformers = pytest.importorskip("transformers")
MXFP4 = pytest.importorskip("transformers.integrations.mxfp4")

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=6, max_position_embeddings=64,
              layer_types=["sliding_attention", "full_attention"], bos_token_id=256,
              eos_token_id=257)
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, in, out) -> blocks (E, out, in / 32, 16) and scales (E, out, in / 32), as gpt-oss
    stores them: per 32 inputs the power of two that brings the largest under 6, each value
    rounded to the nearest e2m1."""
    t = w.transpose(1, 2).float()  # (E, out, in)
    groups = t.unflatten(-1, (-1, 32))  # (E, out, G, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    nearest = (scaled.abs()[..., None] - MAGNITUDES).abs().argmin(-1)  # 0..7
    code = (nearest + 8 * (scaled < 0)).to(torch.uint8)  # the sign in the top bit
    pairs = code.unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent.int() + 127).to(torch.uint8)


def _checkpoints(tmp_path):
    config = transformers.GptOssConfig(**CONFIG)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    packed, plain = {}, {}
    for name, w in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize(w)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            # transformers' own dequantization is the reference
            plain[name] = MXFP4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = plain[name] = w
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    for folder, tensors, cfg in (("mx", packed, {**saved, "quantization_config": quant}),
                                 ("plain", plain, saved)):
        (tmp_path / folder).mkdir()
        save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(json.dumps(cfg))
    return state, packed, plain


def test_mxfp4_experts_dequantize_as_transformers_does_and_import(tmp_path):
    state, packed, plain = _checkpoints(tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert (plain[name] - state[name]).abs().max() > 0  # the test quantizes for real
    assert (plain[name] - state[name]).abs().max() < 0.5 * state[name].abs().max()
    ours = mxfp4.dequantize(packed[name + "_blocks"], packed[name + "_scales"]).transpose(1, 2)
    torch.testing.assert_close(ours, plain[name], rtol=0, atol=0)
    files = SafetensorsFolder(tmp_path / "mx")
    files.enable_mxfp4()
    stored = files.keys()  # a method, not a dict: the names a read answers to
    assert name in stored and name + "_blocks" not in stored
    assert files.shape(name) == tuple(plain[name].shape) == (4, 64, 64)
    region = (slice(1, 3), slice(5, 40), slice(7, 30))  # some experts, rows and columns
    torch.testing.assert_close(files.read(name, region), plain[name][region], rtol=0, atol=0)
    x = ids(t=12)
    with torch.no_grad():
        torch.testing.assert_close(kiln_from_hf(tmp_path / "mx", 32)(x),
                                   kiln_from_hf(tmp_path / "plain", 32)(x), rtol=0, atol=0)
