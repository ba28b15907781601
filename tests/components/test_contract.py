"""One contract test over the whole registry: every built-in component builds from its config
defaults, runs, and (for modules) gives a finite backward and a state-dict round trip."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kiln.components import registry
from tests.checkpointing.elastic import eager

DIM, T, B, V = 64, 16, 2, 300
BUILTIN = [e for e in registry.entries() if e.origin.startswith("kiln.components.")]
assert BUILTIN, "no built-in components found in the registry"


def _default(entry, **values):
    return entry.config(type=entry.name, **values)


def _roundtrip(build, *inputs) -> None:
    """A second instance (other seed) loading the first's state dict computes the same output."""
    torch.manual_seed(1)
    first = build()
    torch.manual_seed(2)
    twin = build()
    twin.load_state_dict(first.state_dict())
    torch.testing.assert_close(twin(*inputs), first(*inputs))


def _finite_backward(out: torch.Tensor, module: nn.Module) -> None:
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def _attention_values(entry) -> dict:
    return {"n_heads": 4, "n_kv_heads": 2} if "n_kv_heads" in entry.config.model_fields else {}


@pytest.mark.parametrize("entry", BUILTIN, ids=lambda e: f"{e.kind}:{e.name}")
def test_component_contract(entry, tmp_path):
    torch.manual_seed(0)
    kind = entry.kind
    if kind == "attention":
        cfg = _default(entry, **_attention_values(entry))
        build = lambda: cfg.build(dim=DIM, layer_idx=1, n_layers=2, max_seq_len=T)  # noqa: E731
        module, x = build(), torch.randn(B, T, DIM)
        out = module(x)
        assert out.shape == x.shape
        _finite_backward(out, module)
        _roundtrip(build, x)
    elif kind == "ffn":
        cfg = _default(entry)
        build = lambda: cfg.build(dim=DIM, layer_idx=0, n_layers=2)  # noqa: E731
        module, x = build(), torch.randn(B, T, DIM)
        out = module(x)
        assert out.shape == (B, T, DIM)
        _finite_backward(out, module)
        _roundtrip(build, x)
    elif kind == "norm":
        module = _default(entry).build(dim=DIM)
        out = module(torch.randn(B, T, DIM))
        assert out.shape == (B, T, DIM)
        _finite_backward(out, module)
    elif kind == "position":
        module = _default(entry).build(head_dim=16, max_seq_len=T)
        q, k = torch.randn(B, T, 4, 16), torch.randn(B, T, 4, 16)
        q2, k2 = module(q, k)
        assert q2.shape == q.shape and k2.shape == k.shape
    elif kind == "model":
        values = {"dim": DIM, "n_layers": 2} if "n_layers" in entry.config.model_fields else {}
        cfg = _default(entry, **values)
        if "attention" in entry.config.model_fields:
            cfg.attention = registry.get("attention", "causal").config(type="causal", n_heads=4)
        build = lambda: cfg.build(vocab_size=V, seq_len=T)  # noqa: E731
        module, ids = build(), torch.randint(0, V, (B, T))
        logits = module(ids)
        assert logits.shape == (B, T, V)
        _finite_backward(logits, module)
        _roundtrip(build, ids)
        assert module.num_params() > 0 and module.flops_per_token(T) > 0
        assert module.blocks()
    elif kind == "adapter":  # on the dense model: trains only itself, round-trips its state
        model_cfg = registry.get("model", "transformer").config(type="transformer", dim=DIM,
                                                                 n_layers=2)
        model_cfg.attention = registry.get("attention", "causal").config(type="causal", n_heads=4)

        def build():
            model = model_cfg.build(vocab_size=V, seq_len=T)
            _default(entry).build().apply(model)
            return model

        module, ids = build(), torch.randint(0, V, (B, T))
        _finite_backward(module(ids), module)
        assert all(p.grad is None for p in module.parameters() if not p.requires_grad)
        _roundtrip(build, ids)
    elif kind == "schedule":
        sched = _default(entry).build(total_steps=100)
        values = [sched(s) for s in range(100)]
        assert all(0 <= v <= 1 for v in values) and max(values) > 0
    elif kind == "optimizer":
        layer = nn.Linear(32, 32, bias=False)
        opt = _default(entry).build([{"params": list(layer.parameters()), "lr": 1e-3,
                                      "peak_lr": 1e-3, "weight_decay": 0.0, "name": "g"}])
        before = layer.weight.detach().clone()
        layer(torch.randn(4, 32)).square().mean().backward()
        with eager():  # the contract, not torchao's compiled 8-bit step (~20 s here; that one
            opt.step()  # is tested compiled in test_adamw8bit.py)
        assert not torch.equal(before, layer.weight)
        assert isinstance(opt.state_dict(), dict)
    elif kind == "tokenizer":
        values = {}
        if "path" in entry.config.model_fields:  # reads a tokenizer file: give it a small one
            from tests.components.tokenizers import tokenizer_files as files

            make = {"sentencepiece": files.sentencepiece_model,
                    "tiktoken": files.tiktoken_ranks}.get(entry.name, files.trained_tokenizer)
            values["path"] = str(make(tmp_path / "tok"))
            if entry.name == "tiktoken":
                values.update(special_tokens=["<s>", "</s>"], bos_token="<s>", eos_token="</s>")
        if "max_bytes" in entry.config.model_fields:  # trains on first use: keep it small
            values.update(max_bytes=200_000, vocab_size=300, cache_dir=str(tmp_path))
        tok = _default(entry, **values).build()
        assert tok.decode(tok.encode("kiln ✓")) == "kiln ✓" and tok.vocab_size > 0
    elif kind == "step":
        assert callable(_default(entry).build())
    elif kind == "preference_loss":  # a batch of pairs: finite per-pair losses, gradients
        from kiln.components.steps.preference_losses import PairLogps

        loss = _default(entry).build()
        chosen, rejected = (-torch.rand(3) * 20).requires_grad_(), -torch.rand(3) * 20
        tokens = torch.tensor([4.0, 7.0, 2.0])
        refs = (chosen.detach() - 1, rejected + 1) if loss.needs_reference else ()
        labels = torch.tensor([True, False, True]) if loss.unpaired else None
        out = loss(PairLogps(chosen, rejected, tokens, tokens + 1, *refs, desirable=labels))
        assert out.losses.shape == out.chosen_rewards.shape == out.rejected_rewards.shape == (3,)
        out.losses.mean().backward()
        assert torch.isfinite(out.losses).all() and torch.isfinite(chosen.grad).all()
        assert not out.chosen_rewards.requires_grad
    elif kind == "reward":  # one finite score per completion, from its text and fields
        from kiln.components.rewards.builtin import Completion

        needs = {"exact_match": {"regex": r"(\d+)"}, "format": {"regex": r"\d"},
                 "length": {"max_tokens": 4, "buffer": 2}}
        reward = _default(entry, **needs.get(entry.name, {})).build()
        done = [Completion(t, n, False, {"answer": "12"}) for t, n in (("= 12", 3), ("x", 6))]
        scores = reward(done)
        assert len(scores) == 2 and all(math.isfinite(x) for x in scores)
    elif kind == "rollout":  # a completion per prompt from a tiny model, with its statistics
        model = registry.get("model", "transformer").config(
            type="transformer", dim=DIM, n_layers=1, attention=registry.get(
                "attention", "causal").config(type="causal", n_heads=4)).build(
                    vocab_size=V, seq_len=T)
        rollout = _default(entry, max_new_tokens=3).build()
        out = rollout(model, [[1, 2, 3], [4]], [7, 8], decode=lambda ids: "", stops=[],
                      eos_id=None, pad_id=0, vocab_size=V, lockstep=False)
        assert [len(s.ids) for s in out] == [3, 3] and all(s.truncated for s in out)
        assert all(len(s.logprobs) == len(s.entropies) == 3 for s in out)
    elif kind == "guard":
        guard = _default(entry).build(run_dir=tmp_path)
        decision = guard.decide({"loss": 2.0, "grad_norm": 1.0}, 0, 0)
        guard.commit(decision, {"loss": 2.0, "grad_norm": 1.0}, 0, 0)
        guard.load_state_dict(guard.state_dict())
    elif kind == "dataset":
        assert _default(entry) is not None  # built with data in their own tests
    elif kind == "task":  # one file with every kind's default fields, a tiny model
        from kiln.components.tasks import runner
        from tests.components.tasks import samples

        path = samples.write_jsonl(tmp_path / "t.jsonl", samples.rows(4))
        task = _default(entry, path=str(path)).build(name="t")
        plan = task.plan(samples.byte_tokenizer(), 192)
        assert plan.units >= plan.examples == 4 and plan.batches
        metrics = runner.run(task, plan, samples.scorer(max_len=192))
        assert metrics and all(map(math.isfinite, metrics.values())), metrics
    else:
        pytest.fail(f"no contract for kind {kind!r}: extend this test")
