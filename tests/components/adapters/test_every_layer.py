"""An adapter on every linear layer of every model family counts wherever the layer computes:
in the training forward (each adapter tensor gets a gradient, the multi-token prediction
modules and the chunked head included) and in generation with the KV cache (the sampled
tokens' log-probabilities equal a full forward's). A fast path that reads a layer's weight
instead of calling the layer (a decode-time stacked q/k/v, a router computed in fp32) would
leave the adapter out silently; the families and layers are the combination test's, not the
ones the adapters were written on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.components.models import generation
from kiln.components.models.block import padded_vocab
from tests.recipes.test_combinations import discovered, recipe_for

VOCAB = 258


def _shared(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (tied embeddings)."""
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def _adapted(family: str, kind: str, tmp_path):
    """The family's toy model with a ``kind`` adapter on every linear layer it can take (not a
    tied output), each update nonzero so that it changes the function."""
    probe = recipe_for(family, tmp_path)
    model = probe.model.build(vocab_size=padded_vocab(probe.model, VOCAB), seq_len=32)
    shared = _shared(model)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and id(m.weight) not in shared]
    targets = "[" + ", ".join(f'"{n}"' for n in names) + "]"
    recipe = recipe_for(family, tmp_path, f"--adapter.type={kind}", "--adapter.rank=2",
                        f"--adapter.targets={targets}", "--adapter.allow_random_base=true")
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=padded_vocab(recipe.model, VOCAB), seq_len=32)
    recipe.adapter.build().apply(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    return model, names


def _chunk_head(hidden: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
    return F.linear(hidden, weight)  # the trainer's chunked loss sees these operands


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("family", list(discovered()))
def test_an_adapter_on_every_linear_layer_trains_and_generates(tmp_path, family, kind):
    model, names = _adapted(family, kind, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    model.train()
    kwargs = {"mtp_labels": ids} if getattr(model, "mtp", None) is not None else {}
    for head in (None, _chunk_head):
        out = model(ids, **kwargs) if head is None else model(ids, head=_chunk_head, **kwargs)
        loss = out.float().square().mean()
        aux = model.pop_aux_loss()
        (loss if aux is None else loss + aux).backward()
    idle = sorted({n.rsplit(".", 2)[0] for n, p in model.named_parameters()
                   if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)})
    assert not idle, f"adapters that got no gradient: {idle}"
    assert {n.rsplit(".", 2)[0] for n, p in model.named_parameters() if p.requires_grad} \
        == set(names)

    model.eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    stats: list = []
    rows = generation.generate(model, prompts, max_new_tokens=6, row_seeds=[1, 2], stats=stats,
                               sampling=generation.Sampling(temperature=1.0), vocab_size=VOCAB)
    for prompt, row, row_stats in zip(prompts, rows, stats, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + row]))[0, len(prompt) - 1:-1, :VOCAB]
        full = F.log_softmax(logits.float(), -1).gather(-1, torch.tensor(row)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([lp for lp, _ in row_stats]), full,
                                   rtol=0, atol=1e-4)
