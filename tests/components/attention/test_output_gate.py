"""Gated attention (Qwen3-Next): kiln's causal attention with ``output_gate`` and QK-norm equals
transformers' ``Qwen3NextAttention`` on the same weights (forward and gradients; its
zero-centred norms and its query / gate projection mapped onto kiln's); the gate is split with
the heads under tensor parallel (tests/parallelisms: the combination matrix's gpt2 family)."""

from __future__ import annotations

import pytest
import torch

from kiln.checkpointing.huggingface.parts import from_hf
from kiln.components.base import default_config

DIM, H, HK, D, T = 32, 4, 2, 8, 12


def test_gated_attention_equals_qwen3_next_attention():
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3NextConfig(
        hidden_size=DIM, num_attention_heads=H, num_key_value_heads=HK, head_dim=D,
        partial_rotary_factor=1.0, rms_norm_eps=1e-6, attention_bias=False,
        max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = qwen3_next.Qwen3NextAttention(config, layer_idx=3).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from their zero init too
    theta = config.rope_parameters["rope_theta"]
    cfg = default_config("attention", "causal", n_heads=H, n_kv_heads=HK, head_dim=D,
                         qk_norm=True, qk_norm_eps=1e-6, output_gate=True,
                         position=default_config("position", "rope", theta=theta))
    ours = cfg.build(dim=DIM, layer_idx=3, n_layers=4, max_seq_len=64).eval()
    with torch.no_grad():
        q, gate = hf.q_proj.weight.view(H, 2, D, DIM).unbind(1)  # per head: D query rows, D gate
        ours.wq.weight.copy_(from_hf(q.reshape(H * D, DIM), H))
        ours.wg.weight.copy_(gate.reshape(H * D, DIM))
        ours.wk.weight.copy_(from_hf(hf.k_proj.weight, HK))
        ours.wv.weight.copy_(hf.v_proj.weight)
        ours.wo.weight.copy_(hf.o_proj.weight)
        for norm, ref in ((ours.q_norm, hf.q_norm), (ours.k_norm, hf.k_norm)):
            norm.weight.copy_(1.0 + from_hf(ref.weight[:, None], 1)[:, 0])  # zero-centred
    x = torch.randn(2, T, DIM, requires_grad=True)
    rotary = qwen3_next.Qwen3NextRotaryEmbedding(config)
    position = rotary(x, torch.arange(T)[None].expand(2, -1))
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    ref, _ = hf(x, position, causal)
    out = ours(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    gx_ref, = torch.autograd.grad(ref.square().sum(), x)
    gx, = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)


def test_the_gate_is_off_by_default_and_trains_when_on():
    cfg = default_config("attention", "causal", n_heads=H, output_gate=True)
    attn = cfg.build(dim=DIM, layer_idx=0, n_layers=1, max_seq_len=T)
    assert not hasattr(default_config("attention", "causal", n_heads=H).build(
        dim=DIM, layer_idx=0, n_layers=1, max_seq_len=T), "wg")
    attn(torch.randn(2, T, DIM)).sum().backward()
    assert attn.wg.weight.grad.abs().sum() > 0
