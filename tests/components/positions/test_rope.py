"""RoPE: the relative-position property, torchtitan's convention, and meta-device rebuilds."""

from __future__ import annotations

import pytest
import torch

from kiln.components.base import default_config


def _rope(head_dim: int = 8, max_seq_len: int = 16, theta: float = 10000.0):
    return default_config("position", "rope", theta=theta).build(
        head_dim=head_dim, max_seq_len=max_seq_len
    )


def test_scores_depend_only_on_position_difference():
    torch.manual_seed(0)
    rope = _rope()
    qv, kv = torch.randn(8), torch.randn(8)
    # The same q and k vectors at every position: (B=1, T=16, H=1, D=8).
    q, k = rope(qv.expand(1, 16, 1, 8), kv.expand(1, 16, 1, 8))
    score = lambda i, j: torch.dot(q[0, i, 0], k[0, j, 0])
    for offset in (0, 1, 5):
        ref = score(offset, 0)
        for shift in (1, 4, 10):
            torch.testing.assert_close(score(offset + shift, shift), ref, atol=1e-5, rtol=1e-5)


def test_matches_torchtitan_complex_pairs():
    """Adjacent dims (2i, 2i+1) rotate by pos * theta**(-2i/D) (torchtitan apply_rotary_emb)."""
    torch.manual_seed(0)
    d, t = 8, 6
    rope = _rope(head_dim=d, max_seq_len=t, theta=500000.0)
    freqs = 1.0 / (500000.0 ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    freqs_cis = torch.polar(torch.ones(t, d // 2), torch.outer(torch.arange(t).float(), freqs))
    q, k = torch.randn(2, t, 3, d), torch.randn(2, t, 1, d)
    want = torch.view_as_real(
        torch.view_as_complex(q.reshape(2, t, 3, -1, 2)) * freqs_cis[None, :, None]
    ).flatten(3)
    got_q, got_k = rope(q, k)
    torch.testing.assert_close(got_q, want)
    assert got_k.shape == k.shape
    # Position 0 is the identity.
    torch.testing.assert_close(got_k[:, 0], k[:, 0])


def test_bf16_in_bf16_out():
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    out, _ = _rope()(q, q)
    assert out.dtype == torch.bfloat16


def test_buffer_not_in_state_dict_and_rebuilt_after_to_empty():
    assert _rope().state_dict() == {}
    with torch.device("meta"):
        meta = _rope()
    meta.to_empty(device="cpu")
    meta.reset_buffers()
    torch.testing.assert_close(meta.freqs_cis, _rope().freqs_cis, atol=0, rtol=0)


def test_too_long_sequence_says_what_to_change():
    q = torch.randn(1, 17, 1, 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        _rope(max_seq_len=16)(q, q)


def test_compile_path_real_ops_equal_complex_path():
    from kiln.components.positions.rope import _rotate, _rotate_real

    torch.manual_seed(0)
    table = _rope().freqs_cis[:5]
    x = torch.randn(2, 5, 3, 8)
    torch.testing.assert_close(_rotate_real(x, table), _rotate(x, table))


def test_partial_rope_turns_the_leading_features_as_a_narrower_head():
    """fraction = 0.25 (Qwen3-Next): the first 4 of 16 features rotate exactly as a RoPE of head
    width 4 (its frequencies), the other 12 pass through; an odd rotated width is refused."""
    torch.manual_seed(0)
    part = default_config("position", "rope", fraction=0.25).build(head_dim=16, max_seq_len=8)
    q, k = torch.randn(2, 8, 3, 16), torch.randn(2, 8, 1, 16)
    got_q, got_k = part(q, k)
    want_q, want_k = _rope(head_dim=4, max_seq_len=8)(q[..., :4], k[..., :4])
    torch.testing.assert_close(got_q[..., :4], want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k[..., :4], want_k, rtol=0, atol=0)
    assert torch.equal(got_q[..., 4:], q[..., 4:]) and torch.equal(got_k[..., 4:], k[..., 4:])
    positions = torch.tensor([3, 5])  # the cached generator's path
    torch.testing.assert_close(part(q[:, :2], k[:, :2], positions=positions)[0][..., :4],
                               _rope(4, 8)(q[:, :2, :, :4], k[:, :2, :, :4],
                                           positions=positions)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"head width \(16\) times position.fraction \(0.1875\) "
                       r"must be even and not zero \(it is 3\)"):
        default_config("position", "rope", fraction=0.1875).build(head_dim=16, max_seq_len=8)
