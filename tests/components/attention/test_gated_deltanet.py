"""Gated DeltaNet: the chunked form equals the recurrent one (forward and gradients, any chunk
size, a carried state, document boundaries); the recurrent form equals transformers' reference;
the layer equals transformers' ``Qwen3NextGatedDeltaNet`` on the same weights (grouped heads);
the cached generator (a fixed-size state) equals a full forward, padded or not; a packed row
equals its documents alone; the hybrid pattern and what cannot hold it are one clear line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.components.attention.context import build_context
from kiln.components.attention.delta_rule import chunk_gated_delta, recurrent_gated_delta
from kiln.components.attention.gated_deltanet import GatedDeltaNetConfig
from kiln.components.errors import RecipeError
from kiln.parallelisms.layout.check import model_problems
from kiln.recipes.config.files import load_recipe
from tests.components.attention.decoding import decode
from tests.conftest import CONFIGS

HYBRID = ["--model.dim=32", "--model.n_layers=4", "--model.attention.n_heads=4",
          "--model.ffn.hidden_dim=48", "--training.seq_len=32",
          '--model.layer_types=["linear","linear","linear","full"]',
          "--model.linear_attention.type=gated_deltanet", "--model.linear_attention.n_heads=4",
          "--model.linear_attention.n_key_heads=2", "--model.linear_attention.head_dim=8",
          "--model.linear_attention.chunk_size=8"]


def _inputs(b=2, t=29, h=3, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -torch.rand(b, t, h, generator=g) * 2
    beta = torch.rand(b, t, h, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


@pytest.mark.parametrize("chunk", [4, 7, 64])
@pytest.mark.parametrize("documents", [False, True])
def test_the_chunked_form_equals_the_recurrent_one(chunk, documents):
    inputs = _inputs()
    state = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(1))
    doc_ids = starts = None
    if documents:  # boundaries inside chunks and on one chunk's edge
        doc_ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 15, [0] * 14 + [1] * 15])
        starts = torch.zeros(2, 29, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    _same_results(recurrent_gated_delta(*inputs, state=state, starts=starts),
                  chunk_gated_delta(*inputs, chunk=chunk, state=state, doc_ids=doc_ids), inputs)


def _same_results(reference, chunked, inputs) -> None:
    """Two forms' (output, final state) agree, and so do the inputs' gradients."""
    (ref, ref_state), (out, out_state) = reference, chunked
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_state, ref_state, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((ref * weights).sum(), inputs),
                    torch.autograd.grad((out * weights).sum(), inputs), strict=True):
        assert (a - b).norm() <= 1e-5 * a.norm()


@pytest.mark.parametrize("documents", [False, True])
def test_grouped_keys_in_the_chunked_form_equal_them_repeated(documents):
    """q and k with fewer heads than v (each serving two value heads) in the chunked form equal
    the recurrent form on them repeated per value head; their gradients are the group's sums."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 21, 2, 8, generator=g, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(2, 21, 2, 8, generator=g), dim=-1)
    k.requires_grad_()
    v = torch.randn(2, 21, 4, 6, generator=g, requires_grad=True)
    decay = (-torch.rand(2, 21, 4, generator=g) * 2).requires_grad_()
    beta = torch.rand(2, 21, 4, generator=g, requires_grad=True)
    doc_ids = starts = None
    if documents:
        doc_ids = torch.tensor([[0] * 6 + [1] * 15, [0] * 13 + [1] * 8])
        starts = torch.zeros(2, 21, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    inputs = (q, k, v, decay, beta)
    repeated = (q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2), v, decay, beta)
    _same_results(recurrent_gated_delta(*repeated, starts=starts),
                  chunk_gated_delta(*inputs, chunk=8, doc_ids=doc_ids), inputs)


def test_the_recurrent_form_equals_transformers_reference():
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, decay, beta = (x.detach() for x in _inputs())
    state = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(1))
    theirs, their_state = qwen.torch_recurrent_gated_delta_rule(
        q, k, v, decay, beta, initial_state=state, output_final_state=True)
    ours, our_state = recurrent_gated_delta(q * 8 ** -0.5, k, v, decay, beta, state=state)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_state, their_state, rtol=1e-5, atol=1e-6)


def _layer(h=4, hk=2, dk=8, dv=6, dim=32):
    cfg = GatedDeltaNetConfig(type="gated_deltanet", n_heads=h, n_key_heads=hk, head_dim=dk,
                              v_head_dim=dv, chunk_size=8)
    torch.manual_seed(0)
    layer = cfg.build(dim=dim, layer_idx=0, n_layers=1, max_seq_len=64)
    layer.init_weights(0.2, 0.2)
    with torch.no_grad():
        layer.norm_weight.add_(torch.randn(dv) * 0.2)
    return layer


def _qwen3_next(layer, h=4, hk=2, dk=8, dv=6, dim=32):
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(hidden_size=dim, linear_num_value_heads=h, linear_num_key_heads=hk,
                             linear_key_head_dim=dk, linear_value_head_dim=dv,
                             linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["linear_attention"])
    ref = qwen.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    r = h // hk
    rows = lambda lin, size: lin.weight.detach().view(hk, size, -1)  # noqa: E731 (per key head)
    qkvz = torch.cat([rows(layer.wq, dk), rows(layer.wk, dk), rows(layer.wv, r * dv),
                      rows(layer.wz, r * dv)], dim=1).flatten(0, 1)
    ba = torch.cat([rows(layer.wb, r), rows(layer.wa, r)], dim=1).flatten(0, 1)
    ref.load_state_dict({
        "in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba,
        "conv1d.weight": layer.conv.detach(), "dt_bias": layer.dt_bias.detach(),
        "A_log": layer.A_log.detach(), "norm.weight": layer.norm_weight.detach(),
        "out_proj.weight": layer.wo.weight.detach()})
    return ref


def test_the_layer_equals_transformers_qwen3_next_gated_deltanet():
    layer = _layer()
    ref = _qwen3_next(layer)
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    ours, theirs = layer(x), ref(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    g_ours = torch.autograd.grad(ours.square().sum(), [x, layer.conv, layer.A_log])
    g_theirs = torch.autograd.grad(theirs.square().sum(), [x, ref.conv1d.weight, ref.A_log])
    for a, b in zip(g_ours, g_theirs, strict=True):  # the input, the convolution, the decay
        assert (a - b).norm() <= 1e-5 * b.norm()


def _model(*extra):
    recipe = load_recipe(CONFIGS / "debug.toml", [*HYBRID, *extra])
    torch.manual_seed(0)
    return recipe.model.build(vocab_size=258, seq_len=32).eval()


def test_the_hybrid_generates_from_its_state_as_a_full_forward():
    model = _model()
    kinds = [type(b.attention).__name__ for b in model.blocks()]
    assert kinds == ["GatedDeltaNet"] * 3 + ["CausalAttention"]
    ids = torch.randint(0, 258, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
    torch.testing.assert_close(decode(model, ids, prompt=6), full, rtol=1e-4, atol=1e-5)
    valid = torch.ones(2, 14, dtype=torch.bool)
    valid[1, :3] = False  # row 1 left-padded by 3: its tokens decode as they would alone
    padded = decode(model, ids, valid, prompt=6)
    with torch.no_grad():
        alone = model(ids[1:, 3:])
    torch.testing.assert_close(padded[1:, 3:], alone, rtol=1e-4, atol=1e-5)
    state = model.blocks()[0].attention
    assert state.attention_flops_per_token(32) > 0


def test_a_packed_row_equals_its_documents_alone():
    model = _model("--model.attention.document_mask=true")  # the hybrid's one mask
    ids = torch.randint(0, 258, (1, 20), generator=torch.Generator().manual_seed(4))
    doc_ids = torch.tensor([[0] * 7 + [1] * 13])
    with torch.no_grad():
        packed = model(ids, context=build_context(20, doc_ids=doc_ids))
        alone = torch.cat([model(ids[:, :7]), model(ids[:, 7:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("documents", [False, True])
def test_the_causal_convolution_has_the_gradients_of_its_sums(documents):
    """The convolution's own backward (``_CausalConv``) against autograd's numerical gradients,
    in float64, with and without document boundaries (a tap never reaches an earlier one)."""
    from kiln.components.attention.gated_deltanet import _CausalConv

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    same = None
    if documents:
        doc_ids = torch.tensor([[0] * 4 + [1] * 7, [0] * 9 + [1] * 2])
        same = [(doc_ids[:, s:] == doc_ids[:, :-s]).double()[..., None] for s in range(1, 4)]
    assert torch.autograd.gradcheck(lambda a, b: _CausalConv.apply(a, b, same), (x, weight))
    out = _CausalConv.apply(x, weight, same)
    want = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight[:, None], groups=6).transpose(1, 2)
    if documents:  # the second row's last document: its first token sees no earlier one
        assert torch.allclose(out[1, 9], x[1, 9] * weight[:, -1])
    else:
        torch.testing.assert_close(out, want)


def test_what_cannot_hold_it_is_one_clear_line():
    with pytest.raises(RecipeError, match="give both or neither"):
        load_recipe(CONFIGS / "debug.toml", [*HYBRID[:5], '--model.layer_types=["linear",'
                                             '"linear","linear","full"]'])
    with pytest.raises(RecipeError, match="follow model.attention.document_mask"):
        load_recipe(CONFIGS / "debug.toml", [*HYBRID, "--model.linear_attention.document_mask"
                                             "=true"])
    with pytest.raises(RecipeError, match="n_key_heads = 3"):
        load_recipe(CONFIGS / "debug.toml", [*HYBRID, "--model.linear_attention.n_key_heads=3"])
    model = _model()
    for cp, tp in ((2, 1), (1, 2)):
        assert any("Gated DeltaNet layers cannot run" in p
                   for p in model_problems(model, tp=tp, cp=cp)), (cp, tp)
