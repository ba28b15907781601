"""µP on the transformer: equal to the standard parametrization at the base width, and away from
it the init, output multiplier, attention scale and per-group LRs the paper prescribes; the
optimizers that cannot follow it say so; the Hugging Face layout is refused for it."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.checkpointing.huggingface.layout import hf_incompatibility
from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from kiln.recipes.training.optimizer_set import OptimizerSet

V, T = 64, 12


def _model(dim: int = 64, seed: int = 0, ffn: str = "swiglu", attention: str = "causal",
           **values):
    cfg = default_config("model", "transformer", **{"dim": dim, "n_layers": 2, **values})
    cfg.attention = default_config("attention", attention, n_heads=dim // 16)
    cfg.ffn = default_config("ffn", ffn, hidden_dim=2 * dim, **(
        {"n_experts": 4, "top_k": 2} if ffn == "moe" else {}))
    torch.manual_seed(seed)
    return cfg.build(vocab_size=V, seq_len=T)


def _adamw(lr: float = 1e-2):
    return {"main": default_config("optimizer", "adamw", lr=lr, weight_decay=0.1)}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("attention", ["causal", "differential"])
def test_at_the_base_width_mup_is_the_standard_parametrization(tied, attention):
    sp = _model(tie_embeddings=tied, attention=attention)
    mu = _model(tie_embeddings=tied, attention=attention, parametrization="mup", base_dim=64)
    for (name, a), b in zip(sp.state_dict().items(), mu.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, V, (2, T))
    assert torch.equal(sp(ids), mu(ids))
    assert mu.lr_multipliers() == {} and mu.width_multiplier() == 1.0
    groups = OptimizerSet(mu, _adamw(), 10).optimizers["main"].param_groups
    assert [g["name"] for g in groups] == ["main", "main/no_decay"]


@pytest.mark.parametrize("ffn", ["swiglu", "moe"])
def test_away_from_the_base_width_init_lrs_and_output_multiplier(ffn):
    mu = _model(dim=128, ffn=ffn, parametrization="mup", base_dim=32)  # m = 4
    sp = _model(dim=128, ffn=ffn)
    m = 4.0
    wq = mu.layers["0"].attention.wq.weight
    assert wq.std().item() == pytest.approx(0.02 / math.sqrt(m), rel=0.05)
    assert mu.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)  # unchanged
    if ffn == "moe":
        router = mu.layers["0"].feed_forward.router.weight
        assert router.std().item() == pytest.approx(0.02 / m, rel=0.1)
    # The same weights give the standard logits divided by m (the readout multiplier).
    sp.load_state_dict(mu.state_dict())
    ids = torch.randint(0, V, (2, T))
    torch.testing.assert_close(mu(ids), sp(ids) / m)
    mults = mu.lr_multipliers()
    hidden = {n for n, p in mu.named_parameters() if n.startswith("layers.") and p.ndim >= 2}
    assert set(mults) == hidden and set(mults.values()) == {1 / m}
    groups = {g["name"]: g for g in OptimizerSet(mu, _adamw(), 10).optimizers["main"].param_groups}
    assert set(groups) == {"main", "main/mup", "main/no_decay"}
    assert groups["main/mup"]["peak_lr"] == pytest.approx(1e-2 / m)
    assert groups["main"]["peak_lr"] == 1e-2  # embeddings and output (when decayed)
    assert len(groups["main/mup"]["params"]) == len(hidden)


def test_attention_scale_follows_the_base_head_width():
    # head width 16, base head width 64: scores scaled by sqrt(64) / 16 = 2 / sqrt(16), as if
    # the queries were twice as large
    mu = _model(parametrization="mup", base_dim=64, base_head_dim=64)
    sp = _model()
    assert mu.layers["0"].attention.q_scale == 2.0
    with torch.no_grad():
        for block in sp.blocks():
            block.attention.wq.weight.mul_(2.0)
    ids = torch.randint(0, V, (2, T))
    torch.testing.assert_close(mu(ids), sp(ids))
    assert "attention scale" in hf_incompatibility(mu)
    assert "output multiplier" in hf_incompatibility(_model(parametrization="mup", base_dim=32))
    assert hf_incompatibility(_model(parametrization="mup", base_dim=64)) == ""


def test_optimizers_without_a_mup_rule_are_refused():
    mu = _model(dim=128, parametrization="mup", base_dim=64)
    with pytest.raises(RecipeError, match=r"optimizer 'main' \(sgd\): no µP learning-rate rule"):
        OptimizerSet(mu, {"main": default_config("optimizer", "sgd")}, 10)
    muon = {"muon": default_config("optimizer", "muon", params={"ndim": [2],
                                                               "exclude": ["tok_*", "output*"]}),
            "adamw": default_config("optimizer", "adamw", params={"rest": True})}
    with pytest.raises(RecipeError, match='lr_scaling = "spectral"'):
        OptimizerSet(mu, muon, 10)
    muon["muon"].lr_scaling = "spectral"
    opts = OptimizerSet(mu, muon, 10).optimizers
    # Muon keeps its LR (its spectral scaling is width-independent); AdamW's rest has no
    # hidden matrices, so no µP group either
    assert [g["name"] for g in opts["muon"].param_groups] == ["muon"]
    assert all("mup" not in g["name"] for g in opts["adamw"].param_groups)
    signed = {"main": default_config("optimizer", "sign_sgd", lr=1e-3)}
    names = [g["name"] for g in OptimizerSet(mu, signed, 10).optimizers["main"].param_groups]
    assert "main/mup" in names


def test_adapter_matrices_keep_the_optimizers_lr():
    mu = _model(dim=128, parametrization="mup", base_dim=64)
    default_config("adapter", "lora", rank=4, targets=["*.wq"]).build().apply(mu)
    mults = mu.lr_multipliers()
    assert any("lora" in n for n, _ in mu.named_parameters())
    assert not any("lora" in n for n in mults) and any(n.endswith("wq.weight") for n in mults)


def test_latent_attention_takes_the_same_query_scale():
    """Latent attention (MLA): µP's factor on its queries (nope and rope parts alike) equals
    queries twice as large, and the DeepSeek-V3 export names it."""
    sp = _model(attention="latent")
    mu = _model(attention="latent", parametrization="mup", base_dim=64,
                base_head_dim=4 * sp.layers["0"].attention.head_dim)
    assert mu.layers["0"].attention.q_scale == 2.0
    with torch.no_grad():
        for block in sp.blocks():
            attn = block.attention
            (attn.wq if hasattr(attn, "wq") else attn.wq_b).weight.mul_(2.0)
    ids = torch.randint(0, V, (2, T))
    torch.testing.assert_close(mu(ids), sp(ids))
    assert "µP's query scale" in hf_incompatibility(mu)
