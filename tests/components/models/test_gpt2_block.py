"""GPT-2 from kiln's blocks: LayerNorm, tanh-GELU MLP with biases, biased attention without
rotary positions, learned absolute positions, tied embeddings. On the same weights its logits
and gradients equal ``transformers``' ``GPT2LMHeadModel``; generation with the KV cache equals a
full forward; a sequence or generation past the position table is one clear error."""

from __future__ import annotations

import pytest
import torch

from kiln.components.models.block import padded_vocab
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

GPT2 = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.bias=true", "--model.attention.position.type=none",
        "--model.absolute_positions=true", "--model.max_seq_len=16",
        "--model.norm.type=layernorm", "--model.ffn.type=mlp", "--model.ffn.activation=gelu_tanh",
        "--model.ffn.bias=true", "--model.ffn.hidden_dim=128", "--model.tie_embeddings=true",
        "--training.seq_len=16"]


def _kiln():
    recipe = load_recipe(CONFIGS / "debug.toml", GPT2)
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=padded_vocab(recipe.model, 258), seq_len=16)
    with torch.no_grad():  # biases and norms away from their init, so every mapping matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _gpt2_from(model):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=model.vocab_size, n_positions=16, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5)
    hf = transformers.GPT2LMHeadModel(config).eval()
    sd = {"transformer.wte.weight": model.tok_embeddings.weight,
          "transformer.wpe.weight": model.pos_embeddings.weight,
          "transformer.ln_f.weight": model.norm.weight, "transformer.ln_f.bias": model.norm.bias}
    for i, block in enumerate(model.blocks()):
        a, f, p = block.attention, block.feed_forward, f"transformer.h.{i}."
        # GPT-2's Conv1D holds (in, out), the transpose of nn.Linear's weight
        sd |= {p + "ln_1.weight": block.attention_norm.weight,
               p + "ln_1.bias": block.attention_norm.bias,
               p + "ln_2.weight": block.ffn_norm.weight, p + "ln_2.bias": block.ffn_norm.bias,
               p + "attn.c_attn.weight": torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]).t(),
               p + "attn.c_attn.bias": torch.cat([a.wq.bias, a.wk.bias, a.wv.bias]),
               p + "attn.c_proj.weight": a.wo.weight.t(), p + "attn.c_proj.bias": a.wo.bias,
               p + "mlp.c_fc.weight": f.w1.weight.t(), p + "mlp.c_fc.bias": f.w1.bias,
               p + "mlp.c_proj.weight": f.w2.weight.t(), p + "mlp.c_proj.bias": f.w2.bias}
    missing, _ = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"}  # tied to wte
    return hf


def test_logits_and_gradients_equal_transformers_gpt2():
    model = _kiln()
    hf = _gpt2_from(model)
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ours.float().logsumexp(-1).sum().backward()
    theirs.logsumexp(-1).sum().backward()
    h = hf.transformer
    for ours_grad, theirs_grad in (
            (model.pos_embeddings.weight.grad, h.wpe.weight.grad),
            (model.tok_embeddings.weight.grad, h.wte.weight.grad),
            (model.layers["1"].feed_forward.w1.weight.grad, h.h[1].mlp.c_fc.weight.grad.t()),
            (model.layers["0"].attention.wq.bias.grad, h.h[0].attn.c_attn.bias.grad[:32])):
        assert theirs_grad.abs().sum() > 0
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-4, atol=1e-6)


def test_the_kv_cache_generator_equals_a_full_forward():
    from kiln.components.attention.kv_cache import attach

    model = _kiln()
    ids = torch.randint(0, 258, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        with attach(model, batch=2, max_len=10, device="cpu") as session:
            session.begin(None, tokens=6)
            steps = [model(ids[:, :6])]
            session.end()
            for t in range(6, 10):
                session.begin(None)
                steps.append(model(ids[:, t:t + 1]))
                session.end()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_past_the_position_table_is_one_clear_error():
    from kiln.components.attention.kv_cache import attach

    model = _kiln()
    with pytest.raises(ValueError, match="17 tokens; learned absolute positions know 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with (pytest.raises(ValueError, match="know 16 positions .* reaches position 16"),
          torch.no_grad(), attach(model, batch=1, max_len=20, device="cpu") as session):
        for tokens in (16, 1):  # the 17th token has no row
            session.begin(None, tokens=tokens)
            model(torch.zeros(1, tokens, dtype=torch.long))
            session.end()


def test_absolute_positions_need_the_table_size_and_sequences_that_fit_it():
    from kiln.components.errors import RecipeError

    with pytest.raises(RecipeError, match="absolute_positions = true needs model.max_seq_len"):
        load_recipe(CONFIGS / "debug.toml", ["--model.absolute_positions=true"])
    recipe = load_recipe(CONFIGS / "debug.toml", GPT2)
    with pytest.raises(RecipeError, match="a sequence of 32 tokens .* longer than "
                       "model.max_seq_len = 16"):
        recipe.model.build(vocab_size=320, seq_len=32)


def test_tensor_parallel_refuses_learned_positions_by_name():
    from kiln.parallelisms.layout.check import model_problems

    problems = model_problems(_kiln(), tp=2)
    assert any(p.startswith("model.absolute_positions = true cannot run with parallelism.tp = 2")
               for p in problems), problems


def _with_dropout(*extra):
    recipe = load_recipe(CONFIGS / "debug.toml", [*GPT2, *extra])
    torch.manual_seed(0)
    return recipe.model.build(vocab_size=padded_vocab(recipe.model, 258), seq_len=16)


@pytest.mark.parametrize("where", ["--model.dropout=0.3", "--model.attention.dropout=0.3"])
def test_dropout_acts_while_training_only_and_follows_the_seed(where):
    plain, dropped = _with_dropout(), _with_dropout(where)
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(dropped.eval()(ids), plain.eval()(ids))  # off in eval
        dropped.train()
        torch.manual_seed(5)
        a = dropped(ids)
        torch.manual_seed(5)
        b = dropped(ids)
        c = dropped(ids)
    assert torch.equal(a, b) and not torch.allclose(a, c)  # the same seed, the same masks
    assert not torch.allclose(a, plain.eval()(ids))
