"""A prompt shared by a group of rows (``CacheSession.share``): its keys and values are kept once
per group and every decode step gives the logits the rows give with copied caches, for GQA,
QK-norm, looped, sliding-window (the window inside the prompt, past it, beyond the row), sink,
differential, latent (its latent cache and its expanded one) and Gated DeltaNet hybrid models
and left-padded prompts; where it cannot share (a module that caches keys it cannot share, rows
not in equal groups, short prompts) it says so and nothing changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.components.attention import kv_cache
from kiln.components.attention.sinks import written_out
from kiln.components.models.generation import Sampling, generate
from tests.components.attention.test_kv_cache import MODELS, TINY, build
from tests.components.attention.test_latent import MLA

HYBRID = [*TINY, '--model.layer_types=["linear","full"]',
          "--model.linear_attention.type=gated_deltanet", "--model.linear_attention.n_heads=4",
          "--model.linear_attention.head_dim=8"]
SHARING = {"causal": MODELS["causal"],
           "causal_qknorm_yarn_fused": MODELS["causal_qknorm_yarn_fused"],
           "looped": MODELS["looped"], "gated_deltanet_hybrid": HYBRID,
           "causal_window": MODELS["causal_window"],  # window 5: reaches the prompt, then not
           "causal_sinks_window": MODELS["causal_sinks_window"],
           "causal_sinks_long_window": [*TINY, "--model.attention.sinks=true",
                                        "--model.attention.window=32"],
           "differential": MODELS["differential"],
           "differential_window": MODELS["differential_window"],
           "latent": MLA, "latent_window": [*MLA, "--model.attention.window=5"],
           "latent_expanded": [*MLA, "--model.attention.cache=expanded"]}


def decode_groups(model, ids, valid, group, steps, share, **kw):
    """Prefill P prompts (ids (P, L)), give each ``group`` rows, decode ``steps`` tokens;
    returns the decode logits (P * group, steps, V) and whether the session shared."""
    prompts, width = ids.shape
    rows = torch.arange(prompts).repeat_interleave(group)
    nxt = torch.randint(0, 258, (prompts * group, steps),
                        generator=torch.Generator().manual_seed(2))
    out = []
    with torch.no_grad(), kv_cache.attach(model, prompts, width + steps, "cpu") as session:
        session.begin(valid)
        model(ids, **kw)
        session.end()
        shared = session.share(rows) if share else False
        if not shared:
            session.select(rows)
        for i in range(steps):
            session.begin(None)
            out.append(model(nxt[:, i:i + 1], **kw))
            session.end()
    return torch.cat(out, 1), shared


def prompts_with_padding(lengths, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(0, 258, (n,), generator=g)
        valid[i, width - n:] = True
    return ids, valid


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", list(SHARING))
def test_shared_prompt_decodes_what_copied_rows_decode(monkeypatch, name, padded):
    monkeypatch.setattr(kv_cache, "SHARE_MIN_PREFIX", 1)
    model = build(SHARING[name])
    ids, valid = prompts_with_padding([9, 4 if padded else 9, 1 if padded else 9], 9)
    kw = {"loops": 2} if name == "looped" else {}
    copied, _ = decode_groups(model, ids, valid, 3, 6, share=False, **kw)
    shared, did = decode_groups(model, ids, valid, 3, 6, share=True, **kw)
    assert did
    torch.testing.assert_close(shared, copied, rtol=1e-5, atol=1e-5)


def test_a_module_that_cannot_share_leaves_the_session_to_select(monkeypatch):
    """A plugin attention that caches keys with ``update`` but without ``shareable``."""
    monkeypatch.setattr(kv_cache, "SHARE_MIN_PREFIX", 1)
    update = kv_cache.KVCache.update
    monkeypatch.setattr(kv_cache.KVCache, "update",
                        lambda self, *new, shareable=False: update(self, *new))
    model = build(MODELS["causal"])
    ids, valid = prompts_with_padding([9, 9], 9)
    _, did = decode_groups(model, ids, valid, 2, 2, share=True)
    assert not did


def test_share_refuses_rows_not_in_equal_groups_and_short_prompts(monkeypatch):
    model = build(MODELS["causal"])
    ids, valid = prompts_with_padding([9, 9], 9)
    for threshold, rows, expect in [(1, [0, 1, 0, 1], False), (1, [0, 0, 1], False),
                                    (1, [0, 1], False), (10, [0, 0, 1, 1], False),
                                    (9, [0, 0, 1, 1], True)]:
        monkeypatch.setattr(kv_cache, "SHARE_MIN_PREFIX", threshold)
        with torch.no_grad(), kv_cache.attach(model, 2, 12, "cpu") as session:
            session.begin(valid)
            model(ids)
            session.end()
            assert session.share(torch.tensor(rows)) is expect, (threshold, rows)
            if expect:
                with pytest.raises(RuntimeError, match="select after share"):
                    session.select(torch.tensor(rows))
                with pytest.raises(ValueError, match="one valid token per row"):
                    session.begin(torch.ones(4, 2, dtype=torch.bool))
            else:
                assert session.valid.shape[0] == 2  # unchanged: the caller selects


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window", [0, 3, 7, 30])
@pytest.mark.parametrize("sinks", [False, True])
def test_the_merged_parts_equal_attention_over_the_whole_row(fused, window, sinks):
    """Prompt part (its padding masked) and own part, merged by their log-sum-exps, equal
    attention over the row's whole keys: GQA, fp32, with a window (within the row's own
    tokens, into the prompt, past its start) and sinks; the matrix-product form (other
    devices) too."""
    g = torch.Generator().manual_seed(0)
    prompts, group, hq, hk, d, length, own = 2, 3, 4, 2, 8, 7, 5
    q = torch.randn(prompts * group, hq, 1, d, generator=g)
    kp, vp = (torch.randn(prompts, hk, length, d, generator=g) for _ in range(2))
    ko, vo = (torch.randn(prompts * group, hk, own, d, generator=g) for _ in range(2))
    hidden = torch.zeros(prompts, length, dtype=torch.bool)
    hidden[1, :3] = True  # the second prompt's left padding
    shared = kv_cache.SharedPrompt(length, group, hidden)
    sink = torch.randn(hq, generator=g) if sinks else None
    out = kv_cache.shared_prompt_sdpa(q, ko, vo, (kp, vp), shared, window, sink, fused=fused)
    k = torch.cat([kp.repeat_interleave(group, 0), ko], 2)
    v = torch.cat([vp.repeat_interleave(group, 0), vo], 2)
    seen = torch.cat([~hidden.repeat_interleave(group, 0),
                      torch.ones(prompts * group, own, dtype=torch.bool)], 1)  # (B, L + own)
    if window:  # by position: the query is the row's last token, padding does not count
        position = seen.long().cumsum(1)
        seen &= position > position[:, -1:] - window
    if sinks:
        want = written_out(q, k, v, seen[:, None, None], sink)
    else:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None, None],
                                              enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_generate_shares_a_long_group_prompt_and_samples_what_each_row_samples_alone(monkeypatch):
    monkeypatch.setattr(kv_cache, "SHARE_MIN_PREFIX", 6)
    calls = []
    share = kv_cache.CacheSession.share
    monkeypatch.setattr(kv_cache.CacheSession, "share",
                        lambda self, rows: calls.append(share(self, rows)) or calls[-1])
    model = build(MODELS["causal"])
    prompts = [[5, 6, 7, 8, 9, 10, 11]] * 3 + [[1, 2, 3]] * 3  # padded to 7: shared
    seeds = [1, 2, 3, 4, 5, 6]
    warm = Sampling(temperature=1.0)
    together = generate(model, prompts, max_new_tokens=8, sampling=warm, row_seeds=seeds)
    assert calls == [True]
    alone = [generate(model, [p], max_new_tokens=8, sampling=warm, row_seeds=[s])[0]
             for p, s in zip(prompts, seeds, strict=True)]
    assert together == alone
