"""Chunked token log-probabilities: the values and the gradients (hidden states, head weight,
an adapter on the output layer) of whole logits, for any chunk size, with a soft cap and
ignored labels; and a step's ``ctx.token_logprobs`` gives the same chunked or not."""

from __future__ import annotations

import pytest
import torch

from kiln.components.models.lm_head import IGNORE_INDEX, soft_cap
from kiln.components.models.token_logprobs import (
    LogprobHead,
    chunked_token_logprobs,
    label_logprobs,
)
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS


def _case(cap=0.0):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX  # a prompt: no log-prob
    upstream = torch.randn(2, 7, generator=g)  # a sequence loss's per-token gradient
    return hidden, weight, labels, upstream


def _grads(fn, hidden, weight, upstream):
    hidden.grad = weight.grad = None
    out = fn()
    (out * upstream).sum().backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 3, 14, 100])
@pytest.mark.parametrize("cap", [0.0, 5.0])
def test_chunked_equals_whole_logits_values_and_gradients(chunk, cap):
    hidden, weight, labels, upstream = _case()
    whole = _grads(lambda: label_logprobs(soft_cap(hidden @ weight.t(), cap).float(), labels),
                   hidden, weight, upstream)
    chunked = _grads(lambda: chunked_token_logprobs(hidden, weight, labels, cap=cap,
                                                    chunk_tokens=chunk),
                     hidden, weight, upstream)
    assert (whole[0][0, :3] == 0).all() and (whole[0][0, 3:] < 0).all()
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_a_graph_only_the_forward_runs():
    hidden, weight, labels, _ = _case()
    with torch.no_grad():
        got = chunked_token_logprobs(hidden, weight, labels, chunk_tokens=4)
    torch.testing.assert_close(got, label_logprobs((hidden @ weight.t()).detach(), labels))
    assert not got.requires_grad


def test_the_head_runs_on_the_labelled_tokens_only(monkeypatch):
    """A prompt's positions cost no head matmul; a batch with no label keeps its graph (zero
    gradients, as whole logits give)."""
    from kiln.components.models import token_logprobs

    rows = []
    inner = token_logprobs._chunk_logprobs
    monkeypatch.setattr(token_logprobs, "_chunk_logprobs",
                        lambda h, *a: rows.append(h.shape[0]) or inner(h, *a))
    hidden, weight, labels, upstream = _case()
    _grads(lambda: chunked_token_logprobs(hidden, weight, labels, chunk_tokens=4), hidden,
           weight, upstream)
    assert sum(rows) == 2 * (14 - 3)  # forward and backward, the 11 labelled tokens each
    nothing = torch.full_like(labels, IGNORE_INDEX)
    got, grad_h, grad_w = _grads(lambda: chunked_token_logprobs(hidden, weight, nothing),
                                 hidden, weight, upstream)
    assert (got == 0).all() and (grad_h == 0).all() and (grad_w == 0).all()


def test_an_output_adapter_gets_the_gradient_through_the_chunked_head():
    from tests.components.adapters.test_lora import _output_adapter_model

    model = _output_adapter_model(["output", "*.attention.wq"])
    ids = torch.randint(0, 264, (2, 12), generator=torch.Generator().manual_seed(2))
    x, y = ids[:, :-1], ids[:, 1:]
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for head in (None, LogprobHead(y, 5)):
        model.zero_grad()
        logp = label_logprobs(model(x).float(), y) if head is None else model(x, head=head)
        (logp * upstream).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0]["output.lora.A"].abs().sum() > 0
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6)


def _tiny_rows():
    """(a one-layer model, ids (2, 16), their next tokens as labels)"""
    recipe = load_recipe(CONFIGS / "debug.toml", ["--model.dim=32", "--model.n_layers=1",
                                                  "--model.attention.n_heads=2"])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=264, seq_len=16)
    ids = torch.randint(0, 264, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ids, ids.roll(-1, dims=1)


def test_a_steps_token_logprobs_are_the_same_chunked_or_not():
    from tests.components.steps.trainer_stub import StubTrainer

    model, ids, labels = _tiny_rows()
    labels[:, :5] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels}
    ctx = StubTrainer(model)
    whole, trained = ctx.token_logprobs(batch)
    ctx.loss_chunk_tokens = 7
    chunked, _ = ctx.token_logprobs(batch)
    assert trained[:, 5:].all() and not trained[:, :5].any()
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 7])
def test_a_steps_right_padding_after_the_last_label_is_not_computed(chunk):
    """Rows padded to seq_len (preference pairs) run as wide as their last label: the values
    of the whole width (0 after it), the model fed the narrower rows."""
    from tests.components.steps.trainer_stub import StubTrainer

    model, ids, labels = _tiny_rows()
    labels[:, :3] = IGNORE_INDEX
    labels[0, 9:] = labels[1, 6:] = IGNORE_INDEX  # row 0 ends at 9, row 1 at 6
    widths = []
    model.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    ctx = StubTrainer(model)
    ctx.loss_chunk_tokens = chunk
    got, trained = ctx.token_logprobs({"input_ids": ids, "labels": labels})
    assert widths == [9] and got.shape == (2, 16)
    torch.testing.assert_close(trained, labels != IGNORE_INDEX)
    want = label_logprobs(model(ids).float(), labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
