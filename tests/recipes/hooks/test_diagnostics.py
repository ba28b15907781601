"""Module diagnostics, routing health and the trainer's plot refresh: the attention-logit
figures against a direct computation, a looped MoE run whose losses are bit-identical with and
without diagnostics and which logs per-layer, per-loop, carry, router, gradient and update
figures, no hook left behind, dead-expert counting and its warning, experts.jsonl and the
plots a run draws of itself."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from kiln.components.attention.causal import CausalAttention, CausalAttentionConfig
from kiln.components.attention.logit_stats import attention_logit_stats, causal_logit_stats
from kiln.components.ffn.moe import MoE, MoEConfig
from kiln.components.ffn.moe_health import RoutingHealth, router_entropy
from kiln.components.positions.rope import RoPEConfig
from kiln.parallelisms.grads import full_sum_squares
from kiln.recipes.hooks.diagnostics import layer_key
from tests.recipes.test_combinations import recipe_for, train


def _direct(q: torch.Tensor, k: torch.Tensor, rows=slice(None)) -> tuple[float, float]:
    """Max logit and mean row entropy the plain way: repeat kv heads, full softmax; then the
    query positions ``rows``."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    logits = logits.masked_fill(~mask, float("-inf"))[:, :, rows]
    p = logits.softmax(-1)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return float(logits.max()), float(ent.mean())


def test_logit_stats_match_a_direct_computation_in_chunks():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 7, 8) * 3, torch.randn(2, 2, 7, 8)  # GQA: 2 query heads per kv
    want_max, want_ent = _direct(q, k)
    for chunk in (49, 2 * 49, 2**24):  # one head at a time, two, all
        top, ent, rows = causal_logit_stats(q, k, max_elements=chunk).tolist()
        assert top == pytest.approx(want_max, rel=1e-5)
        assert ent / rows == pytest.approx(want_ent, rel=1e-5) and rows == 2 * 4 * 7
    want_max, want_ent = _direct(q, k, [0, 3, 6])  # 3 rows of 7: every 3rd, ending at the last
    top, ent, rows = causal_logit_stats(q, k, rows=3).tolist()
    assert top == pytest.approx(want_max, rel=1e-5) and rows == 2 * 4 * 3
    assert ent / rows == pytest.approx(want_ent, rel=1e-5)


def test_score_inputs_are_what_the_forward_attends_with():
    torch.manual_seed(0)
    cfg = CausalAttentionConfig(type="causal", n_heads=4, n_kv_heads=2, qk_norm=True,
                                position=RoPEConfig(type="rope"))
    attn = CausalAttention(cfg, dim=32, layer_idx=0, n_layers=1, max_seq_len=16)
    x = torch.randn(2, 9, 32)
    (q, k), = attn.score_inputs(x)
    _, _, v = attn.project_qkv(x)
    v = v.transpose(1, 2).repeat_interleave(2, dim=1)
    k = k.repeat_interleave(2, dim=1)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    p = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    out = attn.wo((p @ v).transpose(1, 2).reshape(2, 9, -1))
    assert torch.allclose(out, attn(x), atol=1e-5)
    stats = attention_logit_stats(attn, x)
    top = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~mask, float("-inf")).max()
    assert stats[0] == pytest.approx(float(top.detach()), rel=1e-5)


def test_router_entropy_and_dead_expert_counting():
    torch.manual_seed(0)
    moe = MoE(MoEConfig(type="moe", n_experts=4, top_k=1), dim=8, layer_idx=3, n_layers=4)
    ent, tokens = router_entropy(moe, torch.randn(2, 5, 8)).tolist()
    assert tokens == 10 and 0 < ent / tokens <= 1
    health = RoutingHealth([moe], dead_below=0.1)
    for _ in range(3):
        moe.last_load.copy_(torch.tensor([10.0, 10.0, 20.0, 0.0]))
        health.update()
    moe.last_load.copy_(torch.tensor([10.0, 10.0, 10.0, 0.5]))  # 0.5 < 0.1 * 7.6: still dead
    health.update()
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, -0.2, 0.2]))
    snap = health.snapshot(step=4)
    assert snap.dead_steps == [[0, 0, 0, 4]] and snap.layer_ids == [3]
    assert snap.load[0] == pytest.approx([10 / 30.5, 10 / 30.5, 10 / 30.5, 0.5 / 30.5])
    assert snap.bias_drift[0] == pytest.approx(math.sqrt(0.08 / 4))
    moe.last_load.copy_(torch.tensor([10.0, 10.0, 10.0, 10.0]))
    health.update()
    assert health.snapshot(step=5).dead_steps == [[0, 0, 0, 0]]


def test_full_sum_squares_of_plain_tensors_and_layer_keys():
    a, b = torch.ones(2, 3), torch.full((4,), 2.0)
    got = full_sum_squares([[a], [a, b], []], torch.device("cpu")).tolist()
    assert got == pytest.approx([6.0, 22.0, 0.0], rel=1e-6)
    assert layer_key("layers.3.attention.wq.weight") == "layer3"
    assert layer_key("layers.3._checkpoint_wrapped_module.ffn_norm.weight") == "layer3"
    assert layer_key("tok_embeddings.weight") == "tok_embeddings"


def _diag_lines(folder) -> list[dict]:
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if any(k.startswith("diag/") for k in x)]


@pytest.mark.slow
@pytest.mark.parametrize("step", ["standard", "segmented_bptt"])
def test_looped_moe_losses_equal_without_diagnostics_and_figures_are_logged(tmp_path, step):
    args = ("--training.steps=3", "--model.carry=true", f"--training.step.type={step}",
            "--parallelism.activation_checkpoint=full", "--run.tensorboard=true")
    plain, _ = train(recipe_for("looped_moe", tmp_path / "plain", *args))
    out = io.StringIO()
    diag, trainer = train(recipe_for("looped_moe", tmp_path / "diag", *args,
                                     "--run.diagnostics.interval=2"), out=out)
    assert diag == plain  # bit for bit: the hooks only read
    lines = _diag_lines(tmp_path / "diag")
    assert [x["step"] for x in lines] == [2]
    keys = set(lines[0])
    loops = trainer.model.loops
    for i in range(loops):
        assert {f"diag/state/loop{i}/rms", f"diag/state_grad/loop{i}/norm",
                f"diag/act/layer1/loop{i}/rms", f"diag/attn/layer1/loop{i}/logit_max",
                f"diag/attn/layer2/loop{i}/entropy"} <= keys, i
    assert {"diag/act/layer0/max", "diag/act/layer3/rms", "diag/carry/rms",
            "diag/router/layer1/entropy", "diag/grad/layer/layer1/norm",
            "diag/update/layer/output/ratio", "diag/grad/group/main/norm",
            "diag/update/group/main/no_decay/ratio"} <= keys
    values = lines[0]
    assert all(math.isfinite(v) and v >= 0 for k, v in values.items() if k.startswith("diag/"))
    assert 0 < values["diag/attn/layer0/entropy"] <= math.log(32)  # at most log(T)
    assert "diag  step 2  act rms max" in out.getvalue()
    assert not any(b._forward_hooks for b in trainer.model.blocks())  # disarmed
    assert trainer.model.loop_observer is None
    events = list((tmp_path / "diag" / "tensorboard").glob("events.*"))
    assert events and b"diag/act/layer0" in b"".join(e.read_bytes() for e in events)


def test_without_the_table_no_hook_is_registered(tmp_path):
    from kiln.recipes.hooks.diagnostics import DiagnosticsHook

    _, trainer = train(recipe_for("dense", tmp_path / "r", "--training.steps=1"))
    assert not any(isinstance(h, DiagnosticsHook) for h in trainer.hooks)
    assert not _diag_lines(tmp_path / "r")


@pytest.mark.slow
def test_dense_run_gradients_match_autograd_and_plots_refresh(tmp_path):
    pytest.importorskip("matplotlib")
    out = io.StringIO()
    _, trainer = train(recipe_for("moe", tmp_path / "r", "--training.steps=2",
                                  "--run.diagnostics.interval=1", "--run.plot_interval=1",
                                  "--training.grad_clip=0", "--run.routing.dead_steps=1",
                                  "--run.routing.dead_below=0.99"), out=out)
    last = _diag_lines(tmp_path / "r")[-1]
    want = math.sqrt(sum(float(p.grad.pow(2).sum()) for n, p in
                         trainer.model.named_parameters() if n.startswith("layers.1.")))
    assert last["diag/grad/layer/layer1/norm"] == pytest.approx(want, rel=1e-5)
    assert {p.name for p in (tmp_path / "r" / "plots").iterdir()} == {
        "curves.png", "diagnostics.png"}
    experts = [json.loads(x) for x in (tmp_path / "r" / "experts.jsonl").read_text().splitlines()]
    assert [x["step"] for x in experts] == [1, 2]
    assert sum(experts[0]["load"]["0"]) == pytest.approx(1.0) and len(experts[0]["bias"]["1"]) == 4
    logged = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert "moe/dead_experts" in logged[0] and "moe/layer0/bias_drift" in logged[0]
    assert "is dead: its load has been below 0.99x the mean" in out.getvalue()
