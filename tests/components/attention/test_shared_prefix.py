"""Rows sharing a prompt, run with the prompt once (``attention/shared_prefix.py``): every row's
token log-probabilities and every gradient equal those of the rows run one by one, for each
attention that declares it (causal with GQA, windows and sinks, differential, latent, learned
positions, looped models); models that cannot share say why."""

from __future__ import annotations

import pytest
import torch

from kiln.components.attention import shared_prefix
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.models.token_logprobs import LogprobHead
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.n_kv_heads=2", "--model.ffn.hidden_dim=48", "--training.seq_len=32"]
MODELS = {
    "causal_gqa": TINY,
    # a window shorter than the rows on layer 0, learned sinks: gpt-oss's attention
    "window_sinks": [*TINY, "--model.attention.window=5", "--model.attention.sinks=true",
                     '--model.layer_types=["sliding","full"]'],
    "differential": [*TINY, "--model.attention.type=differential"],
    "latent": ["--model.dim=48", "--model.n_layers=2", "--model.attention.type=latent",
               "--model.attention.n_heads=4", "--model.attention.kv_rank=12",
               "--model.attention.nope_head_dim=8", "--model.attention.rope_head_dim=6",
               "--model.attention.v_head_dim=10", "--model.ffn.hidden_dim=64",
               "--training.seq_len=32"],
    "gpt2": ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
             "--model.attention.bias=true", "--model.attention.position.type=none",
             "--model.absolute_positions=true", "--model.max_seq_len=32",
             "--model.norm.type=layernorm",
             "--model.ffn.type=mlp", "--model.ffn.activation=gelu_tanh", "--model.ffn.bias=true",
             "--model.ffn.hidden_dim=64", "--model.tie_embeddings=true", "--training.seq_len=32"],
    "looped": ["--model.type=looped", "--model.dim=32", "--model.attention.n_heads=4",
               "--model.ffn.hidden_dim=48", "--model.loops=2", "--model.n_recurrent=1",
               "--training.seq_len=32"],
}


def build(overrides, seed=0):
    recipe = load_recipe(CONFIGS / "debug.toml", overrides)
    torch.manual_seed(seed)
    return recipe.model.build(vocab_size=258, seq_len=32).train()


def grouped_rows(groups: int = 3, members: int = 2, prompt: int = 7, width: int = 20, seed=1):
    """(ids (G*K, width), labels, the (G, K) groups): rows of a group share ``prompt`` tokens,
    members of a group are not adjacent (as DPO's chosen block, then its rejected block)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 258, (groups * members, width), generator=g)
    index = torch.arange(groups * members).view(members, groups).T  # (G, K): row g + G * k
    for row in index:
        ids[row, :prompt] = ids[row[0], :prompt]
    labels = torch.roll(ids, -1, 1)
    labels[:, :prompt - 1] = IGNORE_INDEX  # the loss on the completions
    return ids, labels, index


def logprobs_and_grads(model, ids, labels, layout=None):
    model.zero_grad(set_to_none=True)
    head = LogprobHead(labels, 16)
    logp = model(ids, head=head) if layout is None else layout.run(model, ids, head=head)
    (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_shared_prefix_equals_the_rows_run_one_by_one(name):
    model = build(MODELS[name])
    assert shared_prefix.problem(model) is None
    ids, labels, groups = grouped_rows()
    layout = shared_prefix.plan(ids, groups)
    assert layout is not None and layout.prefix == 7
    want, want_grads = logprobs_and_grads(model, ids, labels)
    got, grads = logprobs_and_grads(model, ids, labels, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for key in want_grads:
        torch.testing.assert_close(grads[key], want_grads[key], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=key: f"{k}: {m}")


def test_packed_logits_unpack_to_the_rows_logits():
    model = build(MODELS["window_sinks"]).eval()
    ids, _, groups = grouped_rows(groups=2, members=3)
    layout = shared_prefix.plan(ids, groups)
    with torch.no_grad():
        torch.testing.assert_close(layout.run(model, ids), model(ids), rtol=1e-5, atol=1e-5)


def test_the_prefix_is_the_shortest_groups_and_every_row_keeps_a_token():
    ids, _, groups = grouped_rows(prompt=7)
    ids[groups[1, 1], 5] = 0  # group 1 parts at token 5
    assert shared_prefix.plan(ids, groups).prefix == 5
    same = ids[:1].repeat(4, 1)  # identical rows: the last token stays each row's own
    assert shared_prefix.plan(same, torch.arange(4).view(2, 2)).prefix == ids.shape[1] - 1


def test_no_layout_where_sharing_does_not_pay_or_groups_do_not_cover_the_rows():
    ids, _, groups = grouped_rows(prompt=2, width=20)  # 2 of 20 tokens: under MIN_SHARE
    assert shared_prefix.plan(ids, groups) is None
    ids, _, groups = grouped_rows(prompt=7)
    assert shared_prefix.plan(ids, groups[:2]) is None  # a row left out
    assert shared_prefix.plan(ids, groups[:, :1]) is None  # one member per group
    twice = groups.clone()
    twice[0, 1] = twice[0, 0]
    assert shared_prefix.plan(ids, twice) is None


HYBRID = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
          "--model.ffn.hidden_dim=48", '--model.layer_types=["linear","full"]',
          "--model.linear_attention.type=gated_deltanet", "--model.linear_attention.n_heads=4",
          "--model.linear_attention.n_key_heads=2", "--model.linear_attention.head_dim=8",
          "--model.linear_attention.chunk_size=8"]


@pytest.mark.parametrize("overrides,says", [
    (HYBRID, "GatedDeltaNet"),
    ([*TINY, "--model.ffn.type=moe", "--model.ffn.n_experts=4", "--model.ffn.hidden_dim=16"],
     "MoE"),
    ([*TINY, "--model.attention.dropout=0.1"], "dropout"),
])
def test_models_that_cannot_share_say_why(overrides, says):
    model = build(overrides)
    assert says in shared_prefix.problem(model)


def test_dropout_does_not_stop_an_evaluation_forward():
    model = build([*TINY, "--model.attention.dropout=0.1"]).eval()
    assert shared_prefix.problem(model) is None


def test_a_plugin_attention_must_declare_that_it_shares():
    model = build(TINY)

    class Plugin(type(model.layers["0"].attention)):
        shares_prefix = None  # a third party's attention, subclassed: not declared

    model.layers["0"].attention.__class__ = Plugin
    assert "does not declare shares_prefix" in shared_prefix.problem(model)


@pytest.mark.parametrize("family, queries", [("dense", "wq"), ("diff_layerscale", "wqkv")])
def test_adapters_on_the_output_and_the_queries_train_as_on_whole_rows(family, queries):
    """LoRA on the output layer (its columns join the head the packed rows' hidden states are
    unpacked for) and on the query projection (differential attention's fused wqkv, with µP):
    the adapters' gradients those of the rows one by one."""
    from tests.components.adapters.test_lora import _output_adapter_model

    model = _output_adapter_model(["output", f"*.attention.{queries}"], family=family).train()
    assert shared_prefix.problem(model) is None
    ids, labels, groups = grouped_rows(width=16)
    ids, labels = ids % 264, labels.masked_fill(labels >= 264, 5)
    layout = shared_prefix.plan(ids, groups)
    want, want_grads = logprobs_and_grads(model, ids, labels)
    got, grads = logprobs_and_grads(model, ids, labels, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want_grads["output.lora.A"].abs().sum() > 0
    for key in want_grads:
        torch.testing.assert_close(grads[key], want_grads[key], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=key: f"{k}: {m}")
