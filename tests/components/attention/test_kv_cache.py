"""KV cache: decoding token by token gives the logits of a full forward, for causal (GQA,
QK-norm, RoPE scaling, fused qkv) and differential attention and for looped models (one cache
slot per loop); left-padded rows give the logits they give alone."""

from __future__ import annotations

import pytest
import torch

from kiln.components.attention import kv_cache
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.n_kv_heads=2", "--model.ffn.hidden_dim=48"]
LOOPED = ["--model.type=looped", "--model.dim=32", "--model.attention.n_heads=4",
          "--model.ffn.hidden_dim=48", "--model.loops=3", "--model.n_recurrent=2"]
MODELS = {
    "causal": TINY,
    "causal_qknorm_yarn_fused": [*TINY, "--model.attention.qk_norm=true",
                                 "--model.attention.fused_qkv=true",
                                 "--model.attention.position.scaling=yarn",
                                 "--model.attention.position.factor=2.0",
                                 "--model.attention.position.original_max_seq_len=8"],
    "causal_bias_fused": [*TINY, "--model.attention.bias=true",
                          "--model.attention.fused_qkv=true"],
    "causal_qkv_bias": [*TINY, "--model.attention.qkv_bias=true"],
    "differential": [*TINY, "--model.attention.type=differential"],
    "looped": LOOPED,
    # sliding windows shorter than the rows: layer 0 local, layer 1 global
    "causal_window": [*TINY, "--model.attention.window=5",
                      '--model.layer_types=["sliding","full"]'],
    "differential_window": [*TINY, "--model.attention.type=differential",
                            "--model.attention.window=3"],
    "causal_sinks_window": [*TINY, "--model.attention.sinks=true", "--model.attention.window=4"],
}


def build(overrides, seed=0):
    recipe = load_recipe(CONFIGS / "debug.toml", overrides)
    torch.manual_seed(seed)
    return recipe.model.build(vocab_size=258, seq_len=24).eval()


def decode(model, ids, chunks, **kw):
    """Logits of ids (B, T) fed in pieces of the given sizes through a cache (the first piece
    with a mask of ones, the others as all-valid steps: ``begin(None, n)``)."""
    out = []
    with kv_cache.attach(model, ids.shape[0], ids.shape[1], "cpu") as session:
        start = 0
        for n in chunks:
            session.begin(None if start else torch.ones(ids.shape[0], n, dtype=torch.bool), n)
            out.append(model(ids[:, start:start + n], **kw))
            session.end()
            start += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_decoding_equals_the_full_forward(name):
    model = build(MODELS[name])
    ids = torch.randint(0, 258, (2, 20), generator=torch.Generator().manual_seed(1))
    kw = {"loops": 2} if name == "looped" else {}
    with torch.no_grad():
        full = model(ids, **kw)
        for chunks in ([20], [8, 1, 1, 10], [1] * 20):
            torch.testing.assert_close(decode(model, ids, chunks, **kw), full, rtol=1e-5,
                                       atol=1e-5, msg=f"{name} {chunks}")
    assert all(getattr(m, "kv_cache", None) is None for m in model.modules())  # detached


def test_a_windowed_decode_step_reads_only_its_window(monkeypatch):
    """Without padding, a sliding layer's decode step attends to its last ``window`` keys, no
    mask (its cost stays flat as the text grows); the full layer to every cached key."""
    model = build(MODELS["causal_window"])  # layer 0: window 5, layer 1: full
    ids = torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(3))
    real, keys = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, **kw):
        if q.shape[2] == 1:
            keys.append((k.shape[2], kw.get("attn_mask") is None))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        decode(model, ids, [6] + [1] * 6)
    assert keys == [x for s in range(7, 13) for x in ((5, True), (s, True))]


def test_decoding_projects_q_k_v_with_one_stacked_matrix_when_small(monkeypatch):
    from kiln.components.attention import causal

    model = build(MODELS["causal"])
    attn = model.blocks()[0].attention
    ids = torch.randint(0, 258, (1, 6), generator=torch.Generator().manual_seed(2))
    seen = []
    real = causal.CausalAttention._stacked_qkv
    monkeypatch.setattr(causal.CausalAttention, "_stacked_qkv",
                        lambda self: seen.append(real(self)) or seen[-1])
    with torch.no_grad():
        full = model(ids)
        stacked = decode(model, ids, [3, 1, 1, 1])
        assert len(seen) == 2 and seen[0][0].shape == (  # once per layer and generation
            attn.wq.out_features + 2 * attn.wk.out_features, attn.wq.in_features)
        monkeypatch.setattr(causal, "_STACK_BYTES", 0)  # too large: three projections
        separate = decode(model, ids, [3, 1, 1, 1])
        assert seen[2:] == [False, False]
    torch.testing.assert_close(stacked, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(separate, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["causal", "differential", "looped", "causal_window",
                                  "differential_window", "causal_sinks_window"])
def test_left_padded_rows_equal_their_unpadded_run(name):
    model = build(MODELS[name])
    rows = [torch.randint(0, 258, (n,), generator=torch.Generator().manual_seed(n))
            for n in (9, 4, 1)]
    width = 9
    ids = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], valid[i, width - len(r):] = r, True
    nxt = torch.tensor([[5], [6], [7]])
    with torch.no_grad(), kv_cache.attach(model, 3, width + 1, "cpu") as session:
        session.begin(valid)
        prefill = model(ids)
        session.end()
        session.begin(None)  # one valid token per row after padded prompts
        step = model(nxt)
        session.end()
    with torch.no_grad():
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, nxt[i]])[None])[0]  # (len + 1, V)
            torch.testing.assert_close(prefill[i, width - len(r):], alone[:-1], rtol=1e-5,
                                       atol=1e-5)
            torch.testing.assert_close(step[i, 0], alone[-1], rtol=1e-5, atol=1e-5)
            assert torch.isfinite(prefill[i]).all()  # padding queries stay finite


def test_loop_count_must_stay_fixed():
    model = build(LOOPED)
    ids = torch.randint(0, 258, (1, 4))
    with torch.no_grad(), kv_cache.attach(model, 1, 8, "cpu") as session:
        session.begin(torch.ones(1, 4, dtype=torch.bool))
        model(ids, loops=1)
        session.end()
        session.begin(torch.ones(1, 1, dtype=torch.bool))
        with pytest.raises(RuntimeError, match="loop count"):
            model(ids[:, :1], loops=2)


def test_cache_capacity_is_checked():
    session = kv_cache.CacheSession(1, 4, "cpu")
    with pytest.raises(ValueError, match="holds 4 tokens"):
        session.begin(torch.ones(1, 5, dtype=torch.bool))
