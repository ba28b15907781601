"""Document masking: a packed row of three documents computes, per document, what that document
computes alone (logits and gradients, fp32), in every model family and attention component of
the combination test; and the attention context's masks, positions and kernel choice."""

from __future__ import annotations

import warnings

import pytest
import torch

from kiln.components.attention.context import (
    build_context,
    choose_kernel,
    document_positions,
    sdpa,
)
from kiln.components.errors import RecipeError
from kiln.components.models.block import padded_vocab
from tests.recipes.test_combinations import discovered, recipe_for

LENGTHS = (7, 12, 5)  # three documents packed into one row of 24 tokens
VOCAB = 258


def _model(family: str):
    recipe = recipe_for(family, "unused")
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=padded_vocab(recipe.model, VOCAB), seq_len=32)
    return model.eval()  # no dropout, no carry, all H loops: the same function every call


def _run(model, ids, weights, context=None):
    """Logits and the gradients of sum(logits * weights) (a loss that sees every logit)."""
    model.zero_grad(set_to_none=True)
    logits = model(ids) if context is None else model(ids, context=context)
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("positions", ["per_document", "sequence"])
@pytest.mark.parametrize("family", list(discovered()))
def test_a_packed_row_equals_its_documents_alone(family, positions):
    """Per-document positions: each document at 0.. as when alone. Sequence positions: RoPE
    scores depend on position differences only, so the shifted documents agree as well (not
    with learned absolute positions: a shifted document gets other rows of the table)."""
    if positions == "sequence" and "--model.absolute_positions=true" in discovered()[family][1]:
        pytest.skip("absolute positions: a document shifted in its row is another input")
    model = _model(family)
    torch.manual_seed(1)
    total = sum(LENGTHS)
    ids = torch.randint(0, VOCAB, (2, total))
    weights = torch.randn(2, total, model.vocab_size)
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS)).expand(2, -1)
    ctx = build_context(total, doc_ids=doc_ids, per_document=positions == "per_document")
    packed, packed_grads = _run(model, ids, weights, ctx)
    alone_grads: dict[str, torch.Tensor] = {}
    start = 0
    for n in LENGTHS:
        part = slice(start, start + n)
        logits, grads = _run(model, ids[:, part], weights[:, part])
        torch.testing.assert_close(packed[:, part], logits, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + g
        start += n
    assert packed_grads.keys() == alone_grads.keys()
    for name, g in packed_grads.items():
        torch.testing.assert_close(g, alone_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    # and the mask matters: without it the later documents see the earlier ones
    plain, _ = _run(model, ids, weights)
    assert not torch.allclose(plain[:, LENGTHS[0]:], packed[:, LENGTHS[0]:], atol=1e-4)


def test_masks_positions_and_context_parallel_queries():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert document_positions(doc_ids).tolist() == [[0, 1, 0, 1, 2, 0]]
    ctx = build_context(6, doc_ids=doc_ids, per_document=True)
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                         [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]).bool()
    assert ctx.mask.shape == (1, 1, 6, 6) and torch.equal(ctx.mask[0, 0] == 0, want)
    assert ctx.mask.dtype == torch.float32 and ctx.mask[0, 0, 0, 1] == float("-inf")
    assert ctx.rope_args() == {"positions": ctx.rope_positions, "limit": 6}
    assert ctx.rope_positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    # a context-parallel rank's queries (positions 1 and 4): their rows of the whole mask
    part = build_context(6, doc_ids=doc_ids, query_positions=torch.tensor([1, 4]))
    assert torch.equal(part.mask[0, 0] == 0, want[[1, 4]])
    assert part.rope_positions.tolist() == [1, 4]
    causal = build_context(6, query_positions=torch.tensor([1, 4]))
    assert torch.equal(causal.mask[0, 0] == 0, torch.ones(6, 6).tril().bool()[[1, 4]])
    assert build_context(6) is None  # no documents, the whole sequence: plain causal SDPA
    with pytest.raises(RecipeError, match="document_mask"):
        build_context(6, per_document=True)


def test_the_flex_block_mask_attends_like_the_dense_mask():
    """The CUDA kernel's mask on CPU (forward only: torch 2.13 has no CPU flex backward)."""
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 11 + [1] * 5])
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    for positions in (None, torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])):
        dense = build_context(16, doc_ids=doc_ids, query_positions=positions)
        flex = build_context(16, doc_ids=doc_ids, query_positions=positions, kernel="flex")
        qq = q if positions is None else q[:, :, positions]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex: "materializes the full scores"
            from torch.nn.attention.flex_attention import flex_attention

            got = flex_attention(qq, k, v, block_mask=flex.mask, enable_gqa=True)
        torch.testing.assert_close(got, sdpa(qq, k, v, dense), rtol=1e-5, atol=1e-5)


def test_kernel_choice_by_device():
    assert choose_kernel("auto", torch.device("cpu")) == "sdpa"
    assert choose_kernel("auto", torch.device("cuda", 0)) == "flex"
    assert choose_kernel("sdpa", torch.device("cuda", 0)) == "sdpa"
    with pytest.raises(RecipeError, match="no FlexAttention backward on cpu"):
        choose_kernel("flex", torch.device("cpu"))
