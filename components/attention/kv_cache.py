"""Key/value cache for incremental decoding, shared by kiln's attention modules.

An attention module that supports caching has a ``kv_cache`` attribute (None while training).
``attach(model, batch, max_len)`` gives every such module a ``KVCache`` tied to one
``CacheSession``; each forward then runs only the new tokens. Per forward the session knows the
new tokens' positions and the attention mask, identical for every layer:

- ``session.begin(valid)`` before a forward of T new tokens per row (``valid`` (B, T) bool:
  False marks left padding of shorter prompts; None: T = ``tokens`` valid tokens, a decode
  step); ``session.end()`` after it.
- A module calls ``cache.update(k, v)`` with the new keys/values in SDPA's layout
  (B, H, T, D), after the position rotation, and attends with ``cached_sdpa`` over everything
  cached so far.

The cache is preallocated as (B, H, S, D), SDPA's own layout, and written in place: a decode
step's SDPA reads ``[:, :, :stop]``, each head's keys one contiguous block. A (B, S, H, D) cache
handed SDPA a transposed view, which its CPU kernel read 1.3x slower (docs/benchmarks.md,
"Generation").

Positions count only valid tokens, so a left-padded row sees the positions it would have alone.
Padding is masked out of every query's keys; a padding query attends to itself only (a row
with no valid key would give NaN, and NaN values poison the sums even under a zero weight).

A prompt that several rows repeat (an RL group's completions) is run once; ``session.share``
then keeps its keys and values once per group and gives each row a cache of its own new tokens
only: a decode step's query attends to its group's prompt (the group's queries together, one
matrix product over the prompt's keys) and to its own tokens, and the two softmax parts are
merged by their log-sum-exps (the cascade form of FlashInfer's shared-prefix decoding and of
Hydragen, Juravsky et al. 2024). The prompt's keys are read once per group per step instead of
once per row; on a CPU that costs more than it saves below ``SHARE_MIN_PREFIX`` prompt tokens
(docs/benchmarks.md, "Reinforcement learning").

A module called several times per forward (the core of a looped model runs once per loop, each
time on a different state) gets one cache slot per call, in call order: the keys of loop i at
position t are those loop i computed, exactly as in a full forward. The number of calls per
forward must stay the same for the whole generation (fix the loop count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kiln.components.attention import banded
from kiln.components.attention.context import kernel_attention
from kiln.components.attention.sinks import sink_attention

# Prompt tokens from which a shared prompt's keys are kept once per group (``share``): the
# merge's extra kernel call and elementwise work cost more below (docs/benchmarks.md).
SHARE_MIN_PREFIX = 128


class CacheSession:
    """The state shared by every layer's cache during one generation."""

    def __init__(self, batch: int, max_len: int, device: torch.device | str) -> None:
        self.max_len = max_len
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # (B, S)
        self.count = torch.zeros(batch, 1, dtype=torch.long, device=device)  # valid so far
        self.padded = False  # whether any cached token is padding (then every query needs a mask)
        self.start = 0  # tokens cached before the current forward
        self.stop = 0  # tokens cached after it
        self.positions: torch.Tensor | None = None  # (B, T) of the new tokens
        self.key_positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.mask: torch.Tensor | None = None  # (B, 1, T, S) bool, or None: plain causal
        self.windowed: dict[int, torch.Tensor] = {}  # sliding-window layers' masks, by window
        self.caches: list[KVCache] = []
        self.shared: SharedPrompt | None = None  # set by `share`

    def begin(self, valid: torch.Tensor | None, tokens: int = 1) -> None:
        """Before a forward of ``valid.shape[1]`` new tokens per row (valid: (B, T) bool), or of
        ``tokens`` new tokens per row that are all valid (``valid`` None: a decode step, without
        building, scanning and reading back a mask of ones)."""
        t = tokens if valid is None else valid.shape[1]
        if self.shared is not None and (valid is not None or t != 1):
            raise ValueError("after a shared prompt each forward decodes one valid token per row")
        if self.start + t > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens; {self.start + t} needed")
        self.stop = self.start + t
        if valid is None:
            self.valid[:, self.start:self.stop] = True
            ran = torch.arange(1, t + 1, device=self.count.device) if t > 1 else 1
            self.positions = self.count + ran - 1  # (B, T)
            self.count = self.count + t
        else:
            self.valid[:, self.start:self.stop] = valid
            # A token's position = the valid tokens before it; counted from the running total,
            # so a decode step costs the same at every length (no cumsum over the whole cache).
            ran = valid.long().cumsum(1)  # (B, T)
            self.positions = (self.count + ran - 1).clamp(min=0)  # (B, T)
            self.count = self.count + ran[:, -1:]
            self.padded = self.padded or not bool(valid.all())
        if not self.padded or self.shared is not None:
            # No padding: plain causal attention (one query: it sees every key anyway). Shared
            # prompt: its padding is masked by `SharedPrompt.mask`, each row's own tokens are
            # all valid.
            self.mask = None
        else:
            seen = self.valid[:, :self.stop]  # (B, S)
            q_idx = torch.arange(self.start, self.stop, device=seen.device)[:, None]  # (T, 1)
            k_idx = torch.arange(self.stop, device=seen.device)[None, :]  # (1, S)
            allowed = (k_idx <= q_idx) & seen[:, None, :]  # (B, T, S)
            allowed |= k_idx == q_idx  # padding queries attend to themselves
            self.mask = allowed[:, None]  # (B, 1, T, S)
        self.key_positions[:, self.start:self.stop] = self.positions
        self.windowed = {}
        for cache in self.caches:
            cache.calls = 0

    def window_mask(self, window: int) -> torch.Tensor:
        """(B, 1, T, S) bool for a layer whose queries see themselves and the ``window - 1``
        tokens before them, by position (left padding does not count), built once a forward."""
        if window not in self.windowed:
            q_idx = torch.arange(self.start, self.stop, device=self.valid.device)[:, None]
            k_idx = torch.arange(self.stop, device=self.valid.device)[None, :]
            allowed = (k_idx <= q_idx)[None] & self.valid[:, None, :self.stop]  # (B, T, S)
            gap = self.positions[:, :, None] - self.key_positions[:, None, :self.stop]
            allowed = (allowed & (gap < window)) | (k_idx == q_idx)  # padding sees itself
            self.windowed[window] = allowed[:, None]
        return self.windowed[window]

    def end(self) -> None:
        self.start = self.stop

    def select(self, rows: torch.Tensor) -> None:
        """Between forwards: row i of the cache becomes old row ``rows[i]`` (rows may repeat:
        several continuations scored after one cached context)."""
        if self.shared is not None:
            raise RuntimeError("select after share: the rows' prompts are laid out in groups")
        self.valid, self.count = self.valid[rows], self.count[rows]
        self.key_positions = self.key_positions[rows]
        for cache in self.caches:
            cache.slots = [tuple(t[rows] for t in slot) for slot in cache.slots]

    def share(self, rows: torch.Tensor) -> bool:
        """``select(rows)`` after the first forward, with each prompt's keys and values kept
        once (module docstring) where ``rows`` puts every prompt's rows together in groups of
        one size >= 2, the prompts are at least ``SHARE_MIN_PREFIX`` tokens and every module
        that caches keys can attend to a shared prompt (kiln's causal, differential and latent
        attention, with windows and sinks too; states such as Gated DeltaNet's are copied per
        row as ``select`` does). False, nothing changed, where not: the caller selects."""
        prompts, length = self.valid.shape[0], self.stop
        group = rows.numel() // prompts
        if (group < 2 or rows.numel() != group * prompts or length < SHARE_MIN_PREFIX
                or self.start != length or not any(c.shareable for c in self.caches)
                or any(c.shareable is False for c in self.caches)
                or not torch.equal(rows.cpu(), torch.arange(prompts).repeat_interleave(group))):
            return False
        hidden = ~self.valid[:, :length] if self.padded else None  # (P, L) the prompts' padding
        self.shared = SharedPrompt(length, group, hidden)
        for cache in self.caches:
            if cache.shareable:
                cache.prefixes = [tuple(t[:, :, :length].clone() for t in slot)
                                  for slot in cache.slots]
                cache.slots = [tuple(t.new_empty(rows.numel(), t.shape[1], self.max_len - length,
                                                 t.shape[3]) for t in slot)
                               for slot in cache.slots]
            else:
                cache.slots = [tuple(t[rows] for t in slot) for slot in cache.slots]
        self.valid, self.count = self.valid[rows], self.count[rows]
        self.key_positions = self.key_positions[rows]
        self.mask = None
        return True

    @property
    def limit(self) -> int | None:
        """A bound on the new tokens' positions known without reading them (RoPE's ``limit``):
        without padding they are start..stop - 1; None = the rotation reads their maximum."""
        return None if self.padded else self.stop

    @property
    def causal(self) -> bool:
        """Whether the new tokens still need a causal mask among themselves (T > 1)."""
        return self.stop - self.start > 1


class KVCache:
    """One attention module's keys and values: one preallocated slot per call in a forward."""

    def __init__(self, session: CacheSession) -> None:
        self.session = session
        self.slots: list[tuple[torch.Tensor, ...]] = []
        self.calls = 0
        # Whether the module's keys and values can be shared by a group (``update``'s
        # ``shareable``; None: a module that caches a state, not keys); after ``share``, the
        # prompts' keys and values per slot, P rows, while ``slots`` holds each row's own.
        self.shareable: bool | None = None
        self.prefixes: list[tuple[torch.Tensor, ...]] = []
        # What the module derives once per generation and drops with the cache (causal
        # attention: its q/k/v projections stacked into one matrix).
        self.derived: dict[str, object] = {}
        session.caches.append(self)

    def next_slot(self, make) -> int:
        """The index of this call's slot in ``slots``; the first forward of a generation
        appends ``make()`` (a tuple of tensors, batch first, that ``session.select`` reorders)."""
        i = self.calls
        self.calls += 1
        if i == len(self.slots):
            if self.session.start:
                raise RuntimeError("an attention module was called more often than in the "
                                   "first forward of this generation; keep the loop count fixed")
            self.slots.append(make())
        return i

    def update(self, *new: torch.Tensor, shareable: bool = False) -> tuple[torch.Tensor, ...]:
        """Store the new tokens' tensors, each (B, H, T, D) (keys and values; latent attention
        caches one latent); return each with everything so far, (B, H, S, D), contiguous per
        head (after ``share``: the row's own tokens only; ``prefix()`` has the prompt's).
        ``shareable``: the module attends to a shared prompt through ``cached_sdpa``'s
        ``prefix``."""
        s = self.session
        if self.shareable is not False:  # one call that cannot share decides
            self.shareable = shareable
        i = self.next_slot(lambda: tuple(t.new_empty(*t.shape[:2], s.max_len, t.shape[-1])
                                         for t in new))
        at = s.shared.length if self.prefixes else 0
        out = []
        for stored, t in zip(self.slots[i], new, strict=True):
            stored[:, :, s.start - at:s.stop - at] = t
            out.append(stored[:, :, :s.stop - at])
        return tuple(out)

    def prefix(self) -> tuple[torch.Tensor, ...] | None:
        """After ``share``: the shared prompts' tensors of the slot last updated, each
        (P, H, L, D); else None."""
        return self.prefixes[self.calls - 1] if self.prefixes else None


class SharedPrompt:
    """What ``CacheSession.share`` keeps: the prompts' length (with their left padding), the
    group size, and their padding as an additive mask (P, 1, 1, L) per dtype (None: none)."""

    def __init__(self, length: int, group: int, hidden: torch.Tensor | None) -> None:
        self.length, self.group, self.hidden = length, group, hidden
        self.masks: dict[torch.dtype, torch.Tensor] = {}

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.hidden is None:
            return None
        if dtype not in self.masks:
            m = torch.zeros(self.hidden.shape, dtype=dtype, device=self.hidden.device)
            self.masks[dtype] = m.masked_fill(self.hidden, float("-inf"))[:, None, None]
        return self.masks[dtype]


def shared_prompt_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       prefix: tuple[torch.Tensor, torch.Tensor], shared: SharedPrompt,
                       window: int = 0, sinks: torch.Tensor | None = None,
                       scale: float | None = None, fused: bool | None = None) -> torch.Tensor:
    """One decode step's attention (q (B, Hq, T, D): T queries of the row's newest position,
    e.g. latent attention's heads folded into rows) over the group's prompt (``prefix``: keys
    and values (P, Hk, L, D), B = P * group) and the row's own tokens (k, v (B, Hk, n, D)):
    each part's softmax with its log-sum-exp, merged. ``window``: a sliding-window layer's (the
    row's last ``window`` tokens: its own last ones, then the prompt's, which sit right-aligned
    after its left padding); ``sinks``: learned sink logits (H,), which join the softmax's
    total; ``scale``: SDPA's. ``fused`` (default: on a CPU, fp32 / bf16, values as wide as
    the keys): the parts through the CPU flash kernel, which returns the log-sum-exp."""
    b, h, t, d = q.shape
    kp, vp = prefix
    mask = shared.mask(q.dtype)
    if window:
        own = k.shape[2]
        k, v = k[:, :, max(own - window, 0):], v[:, :, max(own - window, 0):]
        reach = window - own  # the prompt's last tokens the window still sees
        kp, vp = (kp[:, :, -reach:], vp[:, :, -reach:]) if reach > 0 else (None, None)
        if mask is not None and reach > 0:
            mask = mask[..., -reach:]  # the last slot is a token: no group sees only padding
    if fused is None:  # (the kernel wants one head width for q, k and v: not differential's)
        fused = (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
                 and v.shape[-1] == q.shape[-1])
    parts = [_attend_with_lse(q, k, v, None, fused, scale)]  # (B, Hq, T, Dv), (B, Hq, T)
    if kp is not None:
        p, g = kp.shape[0], shared.group
        grouped = q.reshape(p, g, h, t, d).transpose(1, 2).reshape(p, h, g * t, d)
        o1, l1 = _attend_with_lse(grouped, kp, vp, mask, fused, scale)  # (P, Hq, G * T, ...)
        parts.append((o1.reshape(p, h, g, t, -1).transpose(1, 2).reshape(b, h, t, -1),
                      l1.reshape(p, h, g, t).transpose(1, 2).reshape(b, h, t)))
    if sinks is None and len(parts) == 2:
        # softmax over both parts = their outputs weighted by their shares of the total mass
        (o2, l2), (o1, l1) = parts
        return torch.lerp(o2, o1, torch.sigmoid(l1 - l2)[..., None].to(o1.dtype))
    total = torch.stack([lse for _, lse in parts]).logsumexp(0)  # (B, Hq, 1)
    if sinks is not None:
        total = torch.logaddexp(total, sinks.float().view(1, -1, 1))
    return sum(o * (lse - total).exp()[..., None].to(o.dtype) for o, lse in parts)


def _attend_with_lse(q, k, v, mask, fused: bool,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (N, Hq, T, D) over k, v (N, Hk, S, D) and its log-sum-exp
    (N, Hq, T) fp32. Not fused: in matrix products (no public op returns the log-sum-exp)."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale)
    n, hq, t, d = q.shape
    hk = k.shape[1]  # GQA: a key head's query heads fold into its rows (no copies of k, v)
    rows = q.reshape(n, hk, hq // hk * t, d)
    scale = d ** -0.5 if scale is None else scale
    scores = torch.matmul(rows.float(), k.float().transpose(-1, -2)) * scale  # (N, Hk, R, S)
    if mask is not None:
        scores = scores + mask
    lse = scores.logsumexp(-1)
    out = torch.matmul((scores - lse[..., None]).exp().to(v.dtype), v)
    return out.reshape(n, hq, t, -1), lse.reshape(n, hq, t)


def cached_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                session: CacheSession, window: int = 0,
                sinks: torch.Tensor | None = None,
                prefix: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """SDPA of the new queries q (B, H, T, D) over the cached k, v (B, Hk, S, D); ``window``:
    a sliding-window layer's (the cache keeps every key; the mask hides the far ones);
    ``sinks``: learned sink logits (``sinks.sink_attention``).

    Windows without left padding (positions = cache slots) attend only to what they can see: a
    decode step to the last ``window`` keys, unmasked (its cost no longer grows with the text),
    and a first forward of many windows (the prompt) in bands (``banded``). ``prefix``: the
    group's shared prompt (``KVCache.prefix``), k and v then the row's own tokens."""
    if prefix is not None:
        return shared_prompt_sdpa(q, k, v, prefix, session.shared, window, sinks)
    gqa = k.shape[1] != q.shape[1]
    if window and not session.padded:
        t, s = q.shape[2], k.shape[2]
        if t == 1 and s > window:  # a decode step sees the last `window` keys, all of them
            k, v = k[:, :, s - window:], v[:, :, s - window:]
            if sinks is not None:
                return sink_attention(q, k, v, None, sinks)
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        if session.start == 0 and banded.worth_it(t, s, window):
            mask = banded.shared_mask(s, window, q.shape[0], q.device)
            return banded.attend(q, k, v, window, mask, lambda q_, k_, v_, m: kernel_attention(
                q_, k_, v_, m, "sdpa", 0.0, sinks))
    if sinks is not None:
        mask = session.window_mask(window) if window else session.mask  # None: causal
        return sink_attention(q, k, v, mask, sinks)
    if window:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=session.window_mask(window),
                                              enable_gqa=gqa)
    if session.mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=session.mask, enable_gqa=gqa)
    if session.causal and session.start:
        t, s = q.shape[2], k.shape[2]
        if t == 1:  # one new token sees every cached one: no mask, SDPA's unmasked kernel
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        # New tokens after cached ones: SDPA's is_causal aligns top-left, so spell it out.
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=session.causal, enable_gqa=gqa)


def cached_mask(session: CacheSession, window: int = 0) -> torch.Tensor | None:
    """The bool mask (B or 1, 1, T, S) of this forward's T new queries over the S cached keys,
    or None where every query sees every key (one new token, no padding, no window)."""
    if window:
        return session.window_mask(window)
    if session.mask is not None or not session.causal:
        return session.mask
    t, s = session.stop - session.start, session.stop
    return torch.ones(t, s, dtype=torch.bool, device=session.valid.device).tril(s - t)


def supports_cache(model: nn.Module) -> bool:
    """Whether every attention of ``model`` can decode with a cache (kiln's causal and
    differential attention can; a plugin attention without ``kv_cache`` cannot)."""
    blocks = model.blocks() if hasattr(model, "blocks") else []
    return bool(blocks) and all(hasattr(b.attention, "kv_cache") for b in blocks
                                if hasattr(b, "attention"))


@contextlib.contextmanager
def attach(model: nn.Module, batch: int, max_len: int,
           device: torch.device | str) -> Iterator[CacheSession]:
    """Give every cache-capable attention of ``model`` a cache for the block's duration."""
    session = CacheSession(batch, max_len, device)
    modules = [m for m in model.modules() if hasattr(m, "kv_cache")]
    try:
        for m in modules:
            m.kv_cache = KVCache(session)
        yield session
    finally:
        for m in modules:
            m.kv_cache = None
