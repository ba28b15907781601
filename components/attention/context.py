"""Which keys each query sees in a training forward: document masking and context parallelism.

Packed rows hold several documents (``doc_ids``, ``components/data/documents.py``). With
``document_mask`` a token attends only to earlier tokens of its own document; under context
parallelism (``parallelism.cp``) a rank holds some of the sequence's queries and attends over the
whole sequence's keys and values, gathered from its peers. Both are described by one
``AttentionContext``, built once per forward (``build_context``: the trainer calls it for every
micro-batch) and handed by the model to every block's attention (``attention(x, context=...)``).
Without either (``build_context`` returns None) attention is SDPA's plain causal kernel, as
before; generation and evaluation of single documents never build one.

Kernels (``mask_kernel``): ``sdpa`` gives SDPA an additive fp32 (B, 1, Tq, T) mask (0 where a
key is visible, -inf elsewhere), built once per forward and shared by the layers (any device; it
trains on CPU). Additive rather than boolean: SDPA's CPU kernel turns a boolean mask into an
fp32 one in every call and saves that for the backward, one per layer; a shared fp32 mask is
saved once (converted per layer only to a lower-precision query dtype). ``flex`` builds a
FlexAttention ``BlockMask`` (block-sparse: fully masked 128 x 128 tiles are skipped, so a long
row of short documents costs what its documents cost) and runs the compiled
``flex_attention``; torch 2.13 has no FlexAttention backward on CPU, so ``auto`` is ``flex`` on
CUDA and ``sdpa`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kiln.components.attention import banded
from kiln.components.attention.sinks import sink_attention
from kiln.components.errors import RecipeError

KERNELS = ("auto", "sdpa", "flex")


@dataclass
class AttentionContext:
    """One forward's attention layout (see the module doc).

    ``length``: T, tokens of the whole sequence (all context-parallel ranks); ``rope_positions``:
    the RoPE position of each local query, (Tq,) or (B, Tq) long, None = 0..T-1; ``mask``: an
    additive fp32 (B or 1, 1, Tq, T) tensor (``sdpa``) or a ``BlockMask`` (``flex``), None =
    causal;
    ``gather_kv``: context parallel, this rank's keys or values (B, Tq, H, D) -> the whole
    sequence's (B, T, H, D) in sequence order (with a backward that returns each rank its part).
    """

    length: int
    rope_positions: torch.Tensor | None = None
    mask: Any = None
    kernel: str = "sdpa"
    gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None
    # what a sliding-window layer's mask is built from (once per window size and forward)
    query_positions: torch.Tensor | None = None  # (Tq,) long
    doc_ids: torch.Tensor | None = None  # (B, T)
    windowed: dict[Any, Any] = field(default_factory=dict)
    # rows sharing a prompt, packed (``shared_prefix.PrefixLayout``): attention runs through it
    prefix: Any = None

    def mask_for(self, window: int) -> Any:
        """The mask of a layer that sees ``window`` tokens (0: every earlier one)."""
        if not window:
            return self.mask
        if window not in self.windowed:
            device = self.query_positions.device
            if self.kernel == "flex":
                built = _block_mask(self.length, self.query_positions, self.doc_ids, device,
                                    window)
            else:
                visible = visibility(self.length, self.query_positions, self.doc_ids, window)
                built = additive(visible)
            self.windowed[window] = built
        return self.windowed[window]

    def band_for(self, window: int, batch: int) -> torch.Tensor:
        """``banded.additive_mask`` of a layer that sees ``window`` tokens (whole rows:
        queries = keys), once per window size and forward."""
        device = self.query_positions.device
        if self.doc_ids is None:
            return banded.shared_mask(self.length, window, batch, torch.device(device))
        key = ("band", window)
        if key not in self.windowed:
            self.windowed[key] = banded.additive_mask(self.length, window, self.doc_ids,
                                                      self.doc_ids.shape[0], device)
        return self.windowed[key]

    def rope_args(self) -> dict[str, Any]:
        """Keyword arguments for the position component: the positions and their bound (known
        here, so RoPE need not read the positions back from the device to check them)."""
        if self.rope_positions is None:
            return {}
        return {"positions": self.rope_positions, "limit": self.length}

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Keys or values (B, Tq, H, D) of this rank -> those of the whole sequence."""
        return t if self.gather_kv is None else self.gather_kv(t)


def choose_kernel(choice: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``sdpa`` elsewhere; ``flex`` off CUDA is refused."""
    if choice not in KERNELS:
        raise RecipeError(f"model.attention.mask_kernel = {choice!r}; choose one of {KERNELS}")
    if choice == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if choice == "flex" and device.type != "cuda":
        raise RecipeError(
            "model.attention.mask_kernel = \"flex\" needs CUDA: torch 2.13 has no FlexAttention "
            f"backward on {device.type}; use \"sdpa\" (a dense mask) or \"auto\"")
    return choice


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at every document of a row: (B, T) -> (B, T) long."""
    t = doc_ids.shape[1]
    index = torch.arange(t, device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def build_context(length: int, *, doc_ids: torch.Tensor | None = None,
                  query_positions: torch.Tensor | None = None, per_document: bool = False,
                  kernel: str = "sdpa",
                  gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  ) -> AttentionContext | None:
    """The context of one forward over rows of ``length`` tokens (None: plain causal).

    ``doc_ids`` (B, T): the whole rows' documents (document masking), None = one sequence;
    ``query_positions`` (Tq,) long: the positions of this rank's tokens (context parallel), None =
    all of 0..T-1; ``per_document``: RoPE positions restart at every document (needs doc_ids).
    """
    if per_document and doc_ids is None:
        raise RecipeError("model.attention.positions = \"per_document\" needs document "
                          "boundaries: set model.attention.document_mask = true")
    if doc_ids is None and query_positions is None:
        return None
    device = (doc_ids if doc_ids is not None else query_positions).device
    if doc_ids is not None and doc_ids.shape[1] != length:
        raise ValueError(f"doc_ids cover {doc_ids.shape[1]} tokens, the rows {length}")
    q_pos = torch.arange(length, device=device) if query_positions is None else query_positions
    rope = None
    if per_document:
        rope = document_positions(doc_ids)[:, q_pos]  # (B, Tq)
    elif query_positions is not None:
        rope = query_positions  # (Tq,)
    if kernel == "flex":
        mask = _block_mask(length, q_pos, doc_ids, device)
    else:
        mask = additive(visibility(length, q_pos, doc_ids))
    return AttentionContext(length, rope, mask, kernel, gather_kv, q_pos, doc_ids)


def additive(visible: torch.Tensor) -> torch.Tensor:
    """A bool visibility mask as SDPA's additive fp32 mask (0 visible, -inf hidden)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible,
                                                                          float("-inf"))


def visibility(length: int, q_pos: torch.Tensor, doc_ids: torch.Tensor | None,
               window: int = 0) -> torch.Tensor:
    """(B or 1, 1, Tq, T) bool: key j is visible to query i (at q_pos[i]) when j <= q_pos[i],
    with documents when both are in the same document, with a ``window`` when
    q_pos[i] - j < window."""
    k_pos = torch.arange(length, device=q_pos.device)
    mask = q_pos[:, None] >= k_pos[None, :]  # (Tq, T)
    if window:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
    if doc_ids is not None:
        same = doc_ids[:, q_pos, None] == doc_ids[:, None, :]  # (B, Tq, T)
        mask = mask & same
    else:
        mask = mask[None]
    return mask[:, None]


def _block_mask(length: int, q_pos: torch.Tensor, doc_ids: torch.Tensor | None, device,
                window: int = 0):
    from torch.nn.attention.flex_attention import create_block_mask

    span = window or length + 1  # every earlier key is nearer than length + 1
    if doc_ids is None:
        def mask_mod(b, h, q_idx, kv_idx):
            p = q_pos[q_idx]
            return (p >= kv_idx) & (p - kv_idx < span)

        batch = None
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            p = q_pos[q_idx]
            return (p >= kv_idx) & (p - kv_idx < span) & (doc_ids[b, p] == doc_ids[b, kv_idx])

        batch = doc_ids.shape[0]
    # compiled on CUDA: the eager builder materialises the (B, Tq, T) mask
    return create_block_mask(mask_mod, batch, None, len(q_pos), length, device=device,
                             _compile=torch.device(device).type == "cuda")


_compiled_flex = None


def _flex(q, k, v, block_mask, gqa: bool) -> torch.Tensor:
    """The compiled ``flex_attention`` (eager FlexAttention materialises the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled block: traced with it
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         context: AttentionContext | None = None, dropout_p: float = 0.0,
         window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (B, H, Tq, D) over k, v (B, Hk, T, D[v]) by the context's mask: causal
    without one. kv heads broadcast to q heads (GQA) without copies. ``dropout_p``: dropout on
    the attention probabilities (pass 0 outside training). ``window``: a query sees itself and
    the ``window - 1`` keys before it (sliding-window attention; 0 = every earlier key).
    ``sinks`` (H,): learned sink logits (``sinks.sink_attention``).

    `enable_gqa` was as fast as `repeat_interleave` on CPU and does not materialise repeats.
    On CPU with bf16 inputs and small heads (D <= 32) the attention runs in fp32: the CPU
    flash kernel was 1.6x slower in bf16 there (forward + backward, (4, 16, 256, 16), casts
    included); with larger heads or longer sequences bf16 is as fast or faster, so it stays.
    """
    if context is not None and context.prefix is not None:  # rows packed around a shared prompt
        return context.prefix.attend(q, k, v, dropout_p, window, sinks)
    kernel = "sdpa" if context is None else context.kernel
    if kernel == "sdpa" and banded.worth_it(q.shape[2], k.shape[2], window):
        mask = banded.shared_mask(k.shape[2], window, q.shape[0], q.device) \
            if context is None else context.band_for(window, q.shape[0])
        return banded.attend(q, k, v, window, mask, lambda q_, k_, v_, m: kernel_attention(
            q_, k_, v_, m, kernel, dropout_p, sinks))
    mask = None if context is None else context.mask_for(window)
    if mask is None and window:  # rows without a context: causal within the window
        t = k.shape[2]
        mask = additive(visibility(t, torch.arange(t - q.shape[2], t, device=q.device), None,
                                   window))
    return kernel_attention(q, k, v, mask, kernel, dropout_p, sinks)


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, kernel: str,
                     dropout_p: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """``sdpa``'s kernels: ``mask`` additive fp32 (``sdpa``) or a ``BlockMask`` (``flex``), None =
    causal."""
    gqa = k.shape[1] != q.shape[1]
    if sinks is not None:
        if kernel == "flex":
            raise RecipeError("model.attention.sinks with the flex kernel: set "
                              "model.attention.mask_kernel = \"sdpa\"")
        return sink_attention(q, k, v, mask, sinks, dropout_p)
    if mask is not None and kernel == "flex":
        if dropout_p:
            raise RecipeError("model.attention.dropout: the flex kernel has no attention "
                              "dropout; set model.attention.mask_kernel = \"sdpa\" or dropout 0")
        return _flex(q, k, v, mask, gqa)
    if mask is not None and mask.dtype != q.dtype and not (
            q.device.type == "cpu" and q.shape[-1] <= 32):  # else the fp32 path below
        mask = mask.to(q.dtype)
    kw = {"is_causal": True} if mask is None else {"attn_mask": mask}
    kw["dropout_p"] = dropout_p
    if q.device.type == "cpu" and q.dtype != torch.float32 and q.shape[-1] <= 32:
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=gqa,
                                                 **kw)
        return out.to(v.dtype)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)
