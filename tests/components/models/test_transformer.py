"""The dense transformer: shapes, causality, tying, soft-cap, meta init, FLOPs, parameter count."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.components.base import default_config

V, T = 64, 12


def _cfg(**values):
    cfg = default_config("model", "transformer", **{"dim": 32, "n_layers": 2, **values})
    cfg.attention.n_heads = 4
    cfg.ffn.hidden_dim = 64
    return cfg


def _model(seed: int = 0, **values):
    torch.manual_seed(seed)
    return _cfg(**values).build(vocab_size=V, seq_len=T)


def test_forward_shape_and_finite_backward():
    m = _model()
    ids = torch.randint(0, V, (3, T))
    logits = m(ids)
    assert logits.shape == (3, T, V)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in m.parameters())


def test_bf16_autocast_forward_backward():
    m = _model(attention=default_config("attention", "causal", n_kv_heads=2, qk_norm=True))
    with torch.autocast("cpu", torch.bfloat16):
        logits = m(torch.randint(0, V, (2, T)))
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in m.parameters())


def test_future_tokens_never_change_earlier_logits():
    m = _model()
    ids = torch.randint(0, V, (2, T))
    ids2 = ids.clone()
    ids2[:, 7] = (ids2[:, 7] + 1) % V
    a, b = m(ids), m(ids2)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_protocol_names_and_blocks():
    m = _model()
    assert len(m.blocks()) == 2 and m.blocks()[1] is m.layers["1"]
    names = {n for n, _ in m.named_parameters()}
    assert {"tok_embeddings.weight", "norm.weight", "output.weight",
            "layers.0.attention.wq.weight", "layers.0.attention.wo.weight",
            "layers.1.feed_forward.w2.weight", "layers.1.attention_norm.weight"} <= names


def test_tied_embeddings_are_one_parameter():
    m = _model(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    untied = _model()
    assert m.num_params() == untied.num_params() - V * 32
    assert len(list(m.parameters())) == len(list(untied.parameters())) - 1


def test_logit_softcap_bounds_logits():
    m = _model(logit_softcap=0.5)
    with torch.no_grad():
        m.output.weight.mul_(1000)
    logits = m(torch.randint(0, V, (2, T)))
    assert logits.abs().max() <= 0.5
    assert logits.abs().max() > 0.4  # saturating, not zeroed


@pytest.mark.parametrize("values", [{}, {"tie_embeddings": True, "layerscale_init": 0.1}])
def test_init_after_to_empty_from_meta_equals_normal_build(values):
    ref = _model(seed=3, **values)
    with torch.device("meta"):
        meta = _cfg(**values).build(vocab_size=V, seq_len=T)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    assert meta.state_dict().keys() == ref.state_dict().keys()
    for (name, a), b in zip(ref.state_dict().items(), meta.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    rope = meta.layers["0"].attention.position
    torch.testing.assert_close(rope.freqs_cis, ref.layers["0"].attention.position.freqs_cis)
    ids = torch.randint(0, V, (1, T))
    torch.testing.assert_close(meta(ids), ref(ids))


def test_init_scales():
    m = _cfg(dim=256).build(vocab_size=V, seq_len=T)
    assert abs(m.tok_embeddings.weight.std().item() - 1.0) < 0.05
    assert m.output.weight.abs().max() <= 3 * 256**-0.5 + 1e-6
    wo0 = m.layers["0"].attention.wo.weight.std().item()
    wo1 = m.layers["1"].attention.wo.weight.std().item()
    assert abs(wo0 - 0.02 / math.sqrt(2)) < 1e-3 and abs(wo1 - 0.02 / 2) < 1e-3


def test_flops_per_token_formula():
    m = _model()
    n_matmul = m.num_params() - V * 32  # everything but the embedding table
    # 6N + 12 * L * H * Dh * T = 6N + 12 * 2 * 4 * 8 * 100
    assert m.flops_per_token(100) == 6 * n_matmul + 12 * 2 * 4 * 8 * 100


def test_flops_per_token_counts_active_experts_only():
    """Issue 10 item 8: MFU of an MoE transformer counted every expert, not the k active."""
    c = _cfg()
    c.ffn = default_config("ffn", "moe", n_experts=8, top_k=2, hidden_dim=16,
                           n_shared_experts=1)
    torch.manual_seed(0)
    m = c.build(vocab_size=V, seq_len=T)
    per_expert = 3 * 32 * 16
    idle = 2 * 6 * per_expert  # 2 layers x (8 - 2) routed experts
    assert m.num_params() - m.num_params(active_only=True) == idle
    n_active = m.num_params(exclude_embeddings=True) - idle
    assert m.flops_per_token(100) == 6 * n_active + 12 * 2 * 4 * 8 * 100
    assert m.param_summary() == {"active per token (MoE top-k)": m.num_params() - idle}
    assert _model().param_summary() == {}


def test_llama3_debug_shape_matches_torchtitan():
    """torchtitan's llama3 debug model: dim 256, 6 layers, 16 heads, hidden 768, vocab 2048."""
    cfg = default_config("model", "transformer", dim=256, n_layers=6)
    cfg.attention.n_heads = 16
    cfg.ffn.hidden_dim = 768
    with torch.device("meta"):
        m = cfg.build(vocab_size=2048, seq_len=256)
    emb, layer = 2048 * 256, 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256
    want = 2 * emb + 6 * layer + 256
    assert want == 6_163_712  # torchtitan logs "6,163,712 total parameters"
    assert m.num_params() == want
    assert m.num_params(exclude_embeddings=True) == want - emb
    assert m.flops_per_token(256) == 6 * (want - emb) + 12 * 6 * 16 * 16 * 256


def test_missing_vocab_size_is_explained():
    with pytest.raises(ValueError, match="vocab_size"):
        _cfg().build(vocab_size=0, seq_len=T)


def test_sizes_from_config_override_build_arguments():
    m = _model(vocab_size=80, max_seq_len=20)
    assert m.output.out_features == 80
    assert m.layers["0"].attention.position.max_seq_len == 20
