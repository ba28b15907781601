"""RoPE scaling (linear, llama3, yarn) against transformers' own implementation of the same
config, and the rotation at given positions (KV-cache decoding)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kiln.components.base import default_config
from kiln.components.positions.rope_scaling import inverse_frequencies

CASES = [  # (transformers rope_parameters, kiln rope fields)
    ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
     {"scaling": "linear", "factor": 4.0}),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64, "rope_theta": 500000.0},
     {"scaling": "llama3", "factor": 8.0, "original_max_seq_len": 64, "theta": 500000.0}),
    ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
      "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
     {"scaling": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
      "original_max_seq_len": 8192, "theta": 500000.0}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "rope_theta": 10000.0},
     {"scaling": "yarn", "factor": 4.0, "original_max_seq_len": 64}),
    ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
      "rope_theta": 1e6, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
      "attention_factor": 1.3},
     {"scaling": "yarn", "factor": 16.0, "original_max_seq_len": 4096, "theta": 1e6,
      "beta_fast": 16.0, "beta_slow": 2.0, "yarn_truncate": False, "attention_factor": 1.3}),
]


@pytest.mark.parametrize("hf_params, kiln", CASES, ids=lambda c: str(c.get("rope_type", "")))
def test_frequencies_and_table_match_transformers(hf_params, kiln):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    d, t = 32, 48
    config = transformers.LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d,
                                      rope_parameters=dict(hf_params),
                                      max_position_embeddings=256)
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS[hf_params["rope_type"]](config, "cpu")
    cfg = default_config("position", "rope", **kiln)
    inv, scale = inverse_frequencies(cfg, d)
    torch.testing.assert_close(inv.float(), hf_inv, rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale, rel=1e-12)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, t, d), torch.arange(t)[None])
    table = cfg.build(head_dim=d, max_seq_len=t).freqs_cis.float()  # (T, D/2, [cos, sin])
    # transformers repeats each frequency for the two halves of a head
    torch.testing.assert_close(table[..., 0], cos[0, :, : d // 2], rtol=0, atol=2e-6)
    torch.testing.assert_close(table[..., 1], sin[0, :, : d // 2], rtol=0, atol=2e-6)


def test_scaling_needs_its_fields():
    with pytest.raises(ValidationError, match="original_max_seq_len"):
        default_config("position", "rope", scaling="llama3", factor=8.0)
    with pytest.raises(ValidationError, match="high_freq_factor"):
        default_config("position", "rope", scaling="llama3", original_max_seq_len=8,
                       low_freq_factor=4.0, high_freq_factor=4.0)


def test_linear_scaling_is_position_interpolation():
    plain = default_config("position", "rope").build(head_dim=8, max_seq_len=32)
    linear = default_config("position", "rope", scaling="linear", factor=4.0).build(
        head_dim=8, max_seq_len=32)
    q = torch.randn(1, 8, 2, 8)
    pos = torch.arange(8)[None]
    # position 4p under factor 4 rotates as position p unscaled
    torch.testing.assert_close(linear(q, q, positions=4 * pos)[0], plain(q, q, positions=pos)[0])


def test_explicit_positions_rotate_as_in_the_full_sequence():
    rope = default_config("position", "rope").build(head_dim=8, max_seq_len=16)
    x = torch.randn(2, 16, 3, 8)
    full, _ = rope(x, x)
    pos = torch.tensor([[5, 6, 7], [0, 9, 15]])  # each row its own positions
    picked = torch.stack([x[b, pos[b]] for b in range(2)])  # (2, 3, 3, 8)
    part, _ = rope(picked, picked, positions=pos)
    torch.testing.assert_close(part, torch.stack([full[b, pos[b]] for b in range(2)]))
    with pytest.raises(ValueError, match="max_seq_len"):
        rope(picked, picked, positions=pos + 1)
