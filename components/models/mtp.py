"""Multi-token prediction (DeepSeek-V3 technical report, section 2.2): ``model.mtp_depth = D``
sequential modules, module k predicting the token k + 1 places ahead of the main head's.

Module k (1-based) takes the previous depth's hidden states h^{k-1} (the trunk's last block
output for k = 1) and the embeddings of the tokens k places ahead, and runs::

    h'_i  = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])     (2 dim -> dim, no bias)
    h^k   = Block_k(h')                                          (a block of the model's kind)
    p_i   = softmax(Head(norm_k(h^k_i)))     predicting t_{i+k+1}

with the embedding and the output head shared with the trunk (the concatenation order and the
per-module final norm follow DeepSeek's released checkpoints: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``). The sequence keeps its length: position i has no token k places ahead for
the last k positions of a row, which get a zero embedding and no target; with a document mask a
target in another document than position i is not trained either. Each depth's loss is the mean
cross-entropy over its targets (chunked like the trunk's, so an adapter on the output layer
trains through it); the model adds ``mtp_weight / D`` times their sum to the trunk's loss (its
gradient only: the reported loss stays the trunk's) and logs each depth as ``mtp/loss_k``.

Generation, evaluation's loss and the post-training steps (preference, GRPO) use the trunk
alone; a Hugging Face export drops the modules (transformers' DeepSeek-V3 ignores them too),
kiln's own format keeps them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.components.models.block import build_block, init_blocks, init_component
from kiln.components.models.lm_head import IGNORE_INDEX, chunked_cross_entropy, head_operands


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection, a block and its final norm."""

    def __init__(self, cfg: Any, depth: int, n_layers: int, max_seq_len: int) -> None:
        super().__init__()
        dim = cfg.dim
        self.enorm, self.hnorm = cfg.norm.build(dim=dim), cfg.norm.build(dim=dim)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        # layer index after the trunk's (a differential lambda or an MoE layer sees its depth)
        self.block = build_block(cfg, cfg.attention, n_layers + depth - 1, n_layers + depth,
                                 max_seq_len)
        self.norm = cfg.norm.build(dim=dim)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, context: Any = None
                ) -> torch.Tensor:
        mixed = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(mixed, context=context)


def build(cfg: Any, n_layers: int, max_seq_len: int) -> nn.ModuleList | None:
    if not cfg.mtp_depth:
        return None
    return nn.ModuleList(MTPModule(cfg, k, n_layers, max_seq_len)
                         for k in range(1, cfg.mtp_depth + 1))


@torch.no_grad()
def init_weights(modules: nn.ModuleList, std: float, depth_init: bool, n_layers: int) -> None:
    """Blocks as the trunk's at the indices after it, ``eh_proj`` ~ N(0, std), norms to 1."""
    d = len(modules)
    init_blocks([k.block for k in modules], std, depth_init,
                indices=list(range(n_layers, n_layers + d)), n_layers=n_layers + d)
    for module in modules:
        nn.init.trunc_normal_(module.eh_proj.weight, std=std)
        for norm in (module.enorm, module.hnorm, module.norm):
            init_component(norm, std, std)


def shifted(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """(B, T) -> x[:, k:] padded back to T with ``fill``."""
    return torch.cat([x[:, k:], x.new_full((x.shape[0], k), fill)], dim=1)


def losses(modules: nn.ModuleList, model: nn.Module, hidden: torch.Tensor,
           input_ids: torch.Tensor, labels: torch.Tensor, context: Any = None
           ) -> list[torch.Tensor]:
    """Each depth's mean cross-entropy (fp32) from the trunk's last hidden states (B, T, D),
    the row's token ids and its labels (``labels[i]`` = the token after ``input_ids[i]``)."""
    doc_ids = getattr(context, "doc_ids", None)
    out = []
    for k, module in enumerate(modules, start=1):
        embedded = model.tok_embeddings(shifted(input_ids, k, 0))
        embedded = embedded * (shifted(torch.ones_like(input_ids), k, 0)[..., None])
        hidden = module(embedded, hidden, context)
        target = shifted(labels, k, IGNORE_INDEX)  # the token k + 1 places after position i
        if doc_ids is not None:  # the input k places ahead must be in position i's document
            target = target.masked_fill(shifted(doc_ids, k, -1) != doc_ids, IGNORE_INDEX)
        normed = module.norm(hidden)
        if model.width_mult != 1.0:  # µP's output multiplier, as the trunk's head
            normed = normed * (1.0 / model.width_mult)
        out.append(chunked_cross_entropy(*head_operands(normed, model.output), target,
                                         cap=model.logit_softcap, empty_is_zero=True))
    return out
