"""Rows that share a prompt, computed with the prompt once (prefix sharing).

A preference pair's two rows, and a GRPO group's completions, begin with the same prompt tokens.
Under causal attention a token's hidden state depends only on the tokens before it, so the rows'
hidden states over their shared prefix are equal, and one copy serves all of them. ``plan`` finds
the prefix of ``P`` tokens every row of every group shares (the shortest group's); ``pack`` lays
each group out as one row: the prefix once, then each member's remaining ``C = T - P`` tokens,
``P + K * C`` tokens in place of ``K * (P + C)``. The model runs that row with an
``AttentionContext`` whose ``prefix`` is the layout: RoPE (or learned) positions are the rows'
own (the prefix 0..P-1, every member P..T-1 again), and attention (``attend``) runs in two
parts, the prefix's queries causally over the prefix, each member's queries over the prefix and
its own earlier tokens (a (C, T) mask, with a sliding window where the layer has one), with
gradients into the shared keys and values from every member. ``unpack`` gives the head each row's
hidden states again, so the log-probabilities, the loss and every gradient are those of the rows
run one by one, up to float rounding (the sums are taken in another order).

It is exact only where every token-mixing module is causal attention of this form: a block's
attention declares it with ``shares_prefix = True`` (causal, differential and latent attention);
a module declaring ``shares_prefix = False`` rules it out (Gated DeltaNet's carried state, MoE
routing, whose balance loss and capacity count the batch's tokens), as does dropout while
training (the members would share one mask), a model whose forward takes no context and
compiled blocks (the prompt's length changes with every batch, and each would compile anew).
``problem`` names the first reason, for the start-up log.

Sharing pays where the prefix is a good part of each row: ``plan`` shares from a prefix of
``MIN_SHARE`` of the row and up (below, the two-part attention's copies cost about what the
saved tokens do) and otherwise returns None, and the rows run as they are. Not under context
parallelism or a document mask of several documents per row (the steps that use it run whole,
single-document rows).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.components.attention.context import AttentionContext, additive, sdpa, visibility

MIN_SHARE = 1 / 8  # the prefix's share of a row from which sharing is used


def problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot run rows with a shared prefix (None: it can)."""
    if "context" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}'s forward takes no attention context"
    for name, module in model.named_modules():
        if getattr(type(module), "shares_prefix", None) is False:
            why = getattr(type(module), "prefix_problem", "it declares shares_prefix = False")
            return f"{name} ({type(module).__name__}): {why}"
        attention = getattr(module, "attention", None)
        if isinstance(attention, nn.Module) and \
                getattr(type(attention), "shares_prefix", False) is not True:
            return (f"{name}.attention ({type(attention).__name__}) does not declare "
                    "shares_prefix = True")
        if getattr(module, "_compiled_call_impl", None) is not None:
            return f"{name or 'the model'} is compiled (each prompt length would compile anew)"
        if model.training and _dropout(module):
            return f"{name} has dropout (the rows would share one mask)"
    return None


def _dropout(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return bool(getattr(module, "dropout_p", 0.0))


def common_prefix(ids: torch.Tensor, groups: torch.Tensor) -> int:
    """The number of leading tokens every row of every group shares with its group: ids (B, T),
    groups (G, K) row indices. One host read."""
    rows = ids[groups]  # (G, K, T)
    same = (rows == rows[:, :1]).all(1)  # (G, T)
    return int(same.int().cumprod(1).sum(1).min())


@dataclass
class PrefixLayout:
    """Groups of rows laid out with their shared prefix once (see the module doc)."""

    groups: torch.Tensor  # (G, K) row indices
    prefix: int  # P
    length: int  # T, each row's tokens
    _completion: AttentionContext | None = field(default=None, repr=False)

    @property
    def members(self) -> int:
        return self.groups.shape[1]

    @property
    def own(self) -> int:  # C
        return self.length - self.prefix

    @property
    def packed_tokens(self) -> int:
        """Tokens the packed rows hold: G * (P + K * C)."""
        return self.groups.shape[0] * (self.prefix + self.members * self.own)

    def positions(self, device) -> torch.Tensor:
        """(P + K * C,) long: each packed token's position in its row."""
        p, t = self.prefix, self.length
        return torch.cat([torch.arange(p, device=device),
                          torch.arange(p, t, device=device).repeat(self.members)])

    def pack(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) rows -> (G, P + K * C, ...): each group's prefix, then its members' own."""
        grouped = ids[self.groups]  # (G, K, T, ...)
        return torch.cat([grouped[:, 0, :self.prefix], grouped[:, :, self.prefix:].flatten(1, 2)],
                         dim=1)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(G, P + K * C, ...) -> (B, T, ...) in the rows' order (the prefix copied to each)."""
        g, k, p, c = self.groups.shape[0], self.members, self.prefix, self.own
        rest = packed.shape[2:]
        prefix = packed[:, :p].unsqueeze(1).expand(g, k, p, *rest)
        own = packed[:, p:].unflatten(1, (k, c))
        grouped = torch.cat([prefix, own], dim=2).flatten(0, 1)  # (G * K, T, ...)
        order = torch.empty_like(self.groups.flatten())
        order[self.groups.flatten()] = torch.arange(g * k, device=order.device)
        return grouped[order]

    def run(self, model: nn.Module, ids: torch.Tensor, head=None) -> torch.Tensor:
        """``model(ids)`` (logits (B, T, V)) or ``model(ids, head=head)`` of the rows ``ids``
        (B, T), computed packed: what the rows give one by one."""
        packed, context = self.pack(ids), self.context(ids.device)
        if head is None:
            return self.unpack(model(packed, context=context))
        return model(packed, head=UnpackingHead(self, head), context=context)

    def context(self, device) -> AttentionContext:
        """The packed rows' attention context: their positions, this layout as ``prefix``."""
        return AttentionContext(self.length, rope_positions=self.positions(device), prefix=self)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the packed rows: q (G, H, P + K * C, D), k, v (G, Hk, same, D[v])."""
        g, p, c, n = q.shape[0], self.prefix, self.own, self.members
        head = sdpa(q[:, :, :p], k[:, :, :p], v[:, :, :p], None, dropout_p, window, sinks)

        def members(t: torch.Tensor) -> torch.Tensor:  # (G, H, P + K*C, D) -> (G*K, H, C, D)
            return t[:, :, p:].unflatten(2, (n, c)).transpose(1, 2).flatten(0, 1)

        def keys(t: torch.Tensor) -> torch.Tensor:  # -> (G*K, H, T, D): the prefix, then own
            shared = t[:, :, :p].unsqueeze(1).expand(g, n, *t[:, :, :p].shape[1:])
            return torch.cat([shared.flatten(0, 1), members(t)], dim=2)

        if self._completion is None:  # a member's queries at P..T-1 over keys 0..T-1
            at = torch.arange(p, self.length, device=q.device)
            self._completion = AttentionContext(
                self.length, mask=additive(visibility(self.length, at, None)), query_positions=at)
        out = sdpa(members(q), keys(k), keys(v), self._completion, dropout_p, window, sinks)
        out = out.unflatten(0, (g, n)).transpose(1, 2).flatten(2, 3)  # (G, H, K * C, D)
        return torch.cat([head, out], dim=2)


def plan(ids: torch.Tensor, groups: torch.Tensor) -> PrefixLayout | None:
    """The layout of rows ``ids`` (B, T) in ``groups`` (G, K), or None where sharing would not
    pay (a prefix under ``MIN_SHARE`` of the row) or the groups do not cover each row once."""
    b, t = ids.shape
    if groups.ndim != 2 or groups.shape[1] < 2 or groups.numel() != b:
        return None
    if not torch.equal(groups.flatten().sort().values, torch.arange(b, device=groups.device)):
        return None
    prefix = min(common_prefix(ids, groups), t - 1)  # every member keeps a token of its own
    if prefix < max(1, t * MIN_SHARE):
        return None
    return PrefixLayout(groups, prefix, t)


class UnpackingHead:
    """A model's ``head=`` hook for packed rows: the rows' hidden states unpacked (``unpack``),
    then ``head`` (a ``LogprobHead``, say) on them as if the rows had run one by one."""

    def __init__(self, layout: PrefixLayout, head) -> None:
        self.layout, self.head = layout, head

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
        return self.head(self.layout.unpack(hidden), weight, cap)
