"""Multi-head latent attention (DeepSeek-V2/V3): on the same weights it equals transformers'
``DeepseekV3Attention`` (forward and gradients, with and without a query latent, interleaved
and rotate-half RoPE layouts); the latent-cached and the expanded-cached generators equal a full
forward (left padding, a sliding window); the document mask equals separate documents; the
cache keeps kv_rank + rope_head_dim numbers per token; bad shapes and parallelisms it cannot
hold are one clear line. Context parallel: tests/parallelisms/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from kiln.components.attention.kv_cache import attach
from kiln.components.attention.latent import LatentAttentionConfig, cache_numbers_per_token
from kiln.components.errors import RecipeError
from kiln.parallelisms.layout.check import model_problems
from kiln.recipes.config.files import load_recipe
from tests.components.attention.decoding import decode
from tests.conftest import CONFIGS

DIM, HEADS, NOPE, ROPE, V, KV_RANK = 48, 4, 8, 6, 10, 12
MLA = ["--model.dim=48", "--model.n_layers=2", "--model.attention.type=latent",
       "--model.attention.n_heads=4", "--model.attention.kv_rank=12",
       "--model.attention.nope_head_dim=8", "--model.attention.rope_head_dim=6",
       "--model.attention.v_head_dim=10", "--model.ffn.hidden_dim=64", "--training.seq_len=16"]


def _build(q_rank: int = 0, **fields):
    cfg = LatentAttentionConfig(type="latent", n_heads=HEADS, kv_rank=KV_RANK, q_rank=q_rank,
                                nope_head_dim=NOPE, rope_head_dim=ROPE, v_head_dim=V, **fields)
    torch.manual_seed(0)
    attn = cfg.build(dim=DIM, layer_idx=0, n_layers=1, max_seq_len=32)
    attn.init_weights(std=0.3, out_std=0.3)
    with torch.no_grad():  # norms away from 1, so their mapping matters
        for norm in (getattr(attn, "q_norm", None), attn.kv_norm):
            if norm is not None:
                norm.weight.add_(torch.randn_like(norm.weight) * 0.2)
    return attn


def _deepseek(attn, q_rank: int, interleave: bool):
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_rank or None, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V, rope_interleave=interleave,
        max_position_embeddings=32, attn_implementation="sdpa")
    ref = ds.DeepseekV3Attention(config, layer_idx=0).eval()
    names = {"kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
             "o_proj": "wo", "q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm",
             "q_b_proj": "wq_b"}
    ours = dict(attn.named_parameters())
    state = {}
    for key in ref.state_dict():
        module, leaf = key.rsplit(".", 1)
        w = ours[f"{names[module]}.{leaf}"].detach().clone()
        if not interleave and module in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
            w = _pairs_to_halves(w, module)
        state[key] = w
    ref.load_state_dict(state)
    return ref, ds.DeepseekV3RotaryEmbedding(config)


def _pairs_to_halves(w: torch.Tensor, module: str) -> torch.Tensor:
    """Rows of the rope dimensions from kiln's adjacent pairs to rotate-half order."""
    def permute(rows):  # (..., ROPE) rows -> evens then odds
        return torch.cat([rows[..., 0::2, :], rows[..., 1::2, :]], dim=-2)
    if module == "kv_a_proj_with_mqa":
        return torch.cat([w[:KV_RANK], permute(w[KV_RANK:])])
    heads = w.view(HEADS, NOPE + ROPE, -1)
    return torch.cat([heads[:, :NOPE], permute(heads[:, NOPE:])], dim=1).flatten(0, 1)


@pytest.mark.parametrize("q_rank,interleave", [(0, True), (20, True), (20, False)])
def test_equals_transformers_deepseek_v3_attention(q_rank, interleave):
    attn = _build(q_rank)
    ref, rotary = _deepseek(attn, q_rank, interleave)
    x = torch.randn(2, 11, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    cos_sin = rotary(x, torch.arange(11)[None].expand(2, -1))
    theirs, _ = ref(x, position_embeddings=cos_sin, attention_mask=None)
    ours = attn(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    (g_ours,) = torch.autograd.grad(ours.square().sum(), x, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(theirs.square().sum(), x, retain_graph=True)
    _close(g_ours, g_theirs)
    theirs.square().sum().backward()
    ours.square().sum().backward()
    _close(attn.wkv_b.weight.grad, ref.kv_b_proj.weight.grad)
    _close(attn.kv_norm.weight.grad, ref.kv_a_layernorm.weight.grad)
    _close(attn.wkv_a.weight.grad[:KV_RANK], ref.kv_a_proj_with_mqa.weight.grad[:KV_RANK])


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Within 1e-5 relative, as a whole tensor (single elements near zero differ by the fp32
    summation order of two implementations)."""
    assert theirs.abs().sum() > 0
    assert (ours - theirs).norm() <= 1e-5 * theirs.norm(), (ours - theirs).abs().max()


@pytest.mark.parametrize("extra", [[], ["--model.attention.cache=expanded"],
                                   ["--model.attention.q_rank=16",
                                    "--model.attention.window=4"],
                                   ["--model.attention.score_scale=1.7"]])
def test_the_cached_generators_equal_a_full_forward(extra):
    recipe = load_recipe(CONFIGS / "debug.toml", [*MLA, *extra])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=258, seq_len=16).eval()
    ids = torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
    torch.testing.assert_close(decode(model, ids), full, rtol=1e-4, atol=1e-5)
    # left padding: row 1's first two tokens are padding; its valid tokens decode as alone
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :2] = False
    padded = decode(model, ids, valid)
    with torch.no_grad():
        alone = model(ids[1:, 2:])
    torch.testing.assert_close(padded[1:, 2:], alone, rtol=1e-4, atol=1e-5)


def test_the_latent_generator_sees_an_adapter_on_the_up_projection():
    from kiln.components.adapters.lora import LoRA, LoRAConfig

    recipe = load_recipe(CONFIGS / "debug.toml", MLA)
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=258, seq_len=16).eval()
    LoRA(LoRAConfig(type="lora", targets=["*.wkv_b"])).apply(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.normal_(std=0.5)  # a real update (B starts at zero)
    ids = torch.randint(0, 258, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids)
    torch.testing.assert_close(decode(model, ids), full, rtol=1e-4, atol=1e-5)


def test_the_latent_cache_holds_the_latent_only():
    recipe = load_recipe(CONFIGS / "debug.toml", MLA)
    model = recipe.model.build(vocab_size=258, seq_len=16).eval()
    attn = model.blocks()[0].attention
    assert cache_numbers_per_token(attn) == {"latent": KV_RANK + ROPE,
                                             "expanded": HEADS * (NOPE + ROPE + V)}
    with torch.no_grad(), attach(model, batch=1, max_len=8, device="cpu") as session:
        session.begin(None, tokens=3)
        model(torch.zeros(1, 3, dtype=torch.long))
        session.end()
        (slot,) = attn.kv_cache.slots[0]
    assert slot.shape == (1, 1, 8, KV_RANK + ROPE)


def test_the_document_mask_equals_separate_documents():
    from kiln.components.attention.context import build_context

    recipe = load_recipe(CONFIGS / "debug.toml", MLA)
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=258, seq_len=16).eval()
    ids = torch.randint(0, 258, (1, 12), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    context = build_context(12, doc_ids=doc_ids, per_document=True)
    with torch.no_grad():
        packed = model(ids, context=context)
        first, second = model(ids[:, :5]), model(ids[:, 5:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-5, atol=1e-5)


def test_it_trains_and_counts_its_flops():
    recipe = load_recipe(CONFIGS / "debug.toml", [*MLA, "--model.attention.q_rank=16"])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=258, seq_len=16)
    model(torch.randint(0, 258, (2, 16))).logsumexp(-1).mean().backward()
    attn = model.blocks()[0].attention
    for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
        assert getattr(attn, name).weight.grad.abs().sum() > 0, name
    assert attn.attention_flops_per_token(16) == 6 * HEADS * (NOPE + ROPE + V) * 16


def test_bad_shapes_and_parallelisms_are_one_clear_line():
    with pytest.raises(RecipeError, match=r"attention.rope_head_dim \(5\) must be even and not "
                       r"zero \(it is 5\): change attention.rope_head_dim or position.fraction"):
        load_recipe(CONFIGS / "debug.toml", [*MLA, "--model.attention.rope_head_dim=5"])
    with pytest.raises(RecipeError, match="sinks"):
        load_recipe(CONFIGS / "debug.toml", [*MLA, "--model.attention.sinks=true"])
    recipe = load_recipe(CONFIGS / "debug.toml", MLA)
    model = recipe.model.build(vocab_size=256, seq_len=16)
    problems = model_problems(model, tp=2)
    assert any("latent attention cannot run with parallelism.tp = 2" in p for p in problems)
