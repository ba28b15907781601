"""Causal attention: masking, GQA against repeated-weight MHA, fused qkv, QK-norm."""

from __future__ import annotations

import pytest
import torch

from kiln.components.attention.causal import fuse_qkv, split_fused_qkv, split_fused_rows
from kiln.components.base import default_config

DIM, T = 32, 10


def _attn(**values):
    cfg = default_config("attention", "causal", **values)
    return cfg.build(dim=DIM, layer_idx=0, n_layers=2, max_seq_len=16)


@pytest.mark.parametrize(
    "values", [{}, {"n_heads": 4, "n_kv_heads": 2}, {"qk_norm": True}, {"fused_qkv": True},
               {"bias": True, "n_heads": 8, "n_kv_heads": 1}],
)
def test_shape_and_causality(values):
    torch.manual_seed(0)
    attn = _attn(**{"n_heads": 4, **values})
    x = torch.randn(2, T, DIM, requires_grad=True)
    y = attn(x)
    assert y.shape == (2, T, DIM)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in attn.parameters())
    x2 = x.detach().clone()
    x2[:, 6:] += torch.randn(2, T - 6, DIM)  # change the future only
    torch.testing.assert_close(attn(x2)[:, :6], y[:, :6].detach())
    assert not torch.allclose(attn(x2)[:, 6:], y[:, 6:])


def test_gqa_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(0)
    gqa, mha = _attn(n_heads=8, n_kv_heads=2), _attn(n_heads=8, n_kv_heads=8)
    hd, rep = DIM // 8, 4
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):  # kv head j serves query heads j*rep .. j*rep + rep - 1
            w = getattr(gqa, name).weight.view(2, hd, DIM).repeat_interleave(rep, dim=0)
            getattr(mha, name).weight.copy_(w.reshape(8 * hd, DIM))
    x = torch.randn(2, T, DIM)
    torch.testing.assert_close(gqa(x), mha(x))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_qkv_equals_unfused_with_concatenated_weights(qk_norm):
    torch.manual_seed(0)
    plain = _attn(n_heads=4, n_kv_heads=2, qk_norm=qk_norm)
    fused = _attn(n_heads=4, n_kv_heads=2, qk_norm=qk_norm, fused_qkv=True)
    assert not hasattr(fused, "wq")
    with torch.no_grad():
        fused.wqkv.weight.copy_(fuse_qkv(plain.wq.weight, plain.wk.weight, plain.wv.weight,
                                         group=2, head_dim=DIM // 4))
        fused.wo.weight.copy_(plain.wo.weight)
    x = torch.randn(2, T, DIM)
    torch.testing.assert_close(fused(x), plain(x))


def test_fused_rows_are_grouped_by_kv_head():
    """wqkv rows: for each kv head its query heads, its key, its value (torchtitan/Megatron), so
    a contiguous slice of whole kv groups (a tensor-parallel shard) is a complete set of heads."""
    hd, hk, group = 2, 2, 3
    q = torch.arange(hk * group * hd).float().unsqueeze(1)  # rows numbered per projection
    k = 100 + torch.arange(hk * hd).float().unsqueeze(1)
    v = 200 + torch.arange(hk * hd).float().unsqueeze(1)
    fused = fuse_qkv(q, k, v, group, hd)
    assert fused[:, 0].tolist()[: (group + 2) * hd] == [0, 1, 2, 3, 4, 5, 100, 101, 200, 201]
    for a, b in zip(split_fused_rows(fused, group, hd), (q, k, v), strict=True):
        assert torch.equal(a, b)
    acts = fused[:, 0].expand(3, -1)  # as activations (..., Hk * (group + 2) * D)
    qa, ka, va = split_fused_qkv(acts, group, hd)
    assert qa.shape == (3, hk * group, hd) and ka.shape == va.shape == (3, hk, hd)
    assert torch.equal(qa[0].flatten(), q.flatten()) and torch.equal(va[0].flatten(), v.flatten())
    # one tensor-parallel half of the rows holds kv head 0 with its 3 query heads
    q0, k0, _ = split_fused_rows(fused[: len(fused) // 2], group, hd)
    assert torch.equal(q0, q[: group * hd]) and torch.equal(k0, k[:hd])


def test_qk_norm_normalises_each_head():
    torch.manual_seed(0)
    attn = _attn(n_heads=4, qk_norm=True)
    seen = {}
    attn.position.register_forward_hook(lambda m, args, out: seen.update(q=args[0], k=args[1]))
    attn(torch.randn(1, T, DIM) * 50)
    for t in seen.values():  # per-head RMS is 1 before the (norm-preserving) rotation
        torch.testing.assert_close(t.pow(2).mean(-1), torch.ones(t.shape[:-1]), atol=1e-3, rtol=0)


def test_bf16_autocast_runs():
    attn = _attn(n_heads=4, n_kv_heads=2, qk_norm=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = attn(torch.randn(2, T, DIM))
    assert y.dtype == torch.bfloat16 and y.isfinite().all()


def test_init_weights_and_rope_after_to_empty():
    with torch.device("meta"):
        attn = _attn(n_heads=4)
    attn.to_empty(device="cpu")
    torch.manual_seed(0)
    attn.init_weights(std=0.02, out_std=0.001)
    assert attn.wo.weight.abs().max() < 0.01
    torch.testing.assert_close(attn.position.freqs_cis, _attn(n_heads=4).position.freqs_cis)


def test_bad_head_counts_say_what_to_change():
    with pytest.raises(ValueError, match="n_kv_heads"):
        _attn(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        _attn(n_heads=5)


def test_cpu_bf16_small_heads_attend_in_fp32():
    from kiln.components.attention.causal import causal_sdpa

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, T, 8, dtype=torch.bfloat16) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True
    ).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        got = causal_sdpa(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
