"""Adapters on a mixture-of-experts base (``checkpoint.init_from``): the routing bias that
aux-loss-free balancing moves is part of the frozen base, so an adapter run leaves it as loaded
(its adapters-only checkpoints do not hold it, and a peft export could not carry it); a stopped
run resumes to the same losses; and ``load_model`` of its checkpoint (export, generate, eval)
gives the trained model, with the base's buffers, not uninitialised memory."""

from __future__ import annotations

import io

import pytest
import torch

from kiln.recipes.config.files import load_recipe
from kiln.recipes.loading.weights import load_model
from kiln.recipes.training.trainer import Trainer
from tests.checkpointing.test_exact_resume import Record
from tests.recipes.test_combinations import TINY
from tests.recipes.test_combinations_finetune import CHAT, chat_recipe

LORA = ("--adapter.rank=4", "--adapter.targets=[\"*.attention.*\", \"*.feed_forward.router\"]")


def _run(folder, steps, *extra, signal_at=None):
    recipe = chat_recipe("deepseek", folder, f"--training.steps={steps}",
                         "--checkpoint.enable=true", "--checkpoint.interval=2", *extra)
    rec = Record(signal_at)
    trainer = Trainer(recipe, hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


def _biases(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}


def test_an_adapter_run_keeps_the_bases_routing_bias_resumes_exactly_and_loads(tmp_path):
    _, base = _run(tmp_path / "base", 3)  # full weights: balancing moves the bias
    start = _biases(base.model)
    assert start and all(b.abs().sum() > 0 for b in start.values())
    init = f"--checkpoint.init_from={tmp_path / 'base'}"
    full, trainer = _run(tmp_path / "full", 4, *LORA, init)
    after = _biases(trainer.model)
    assert after.keys() == start.keys()
    for name, bias in after.items():
        torch.testing.assert_close(bias, start[name], rtol=0, atol=0, msg=name)
    first, _ = _run(tmp_path / "cut", 4, *LORA, init, signal_at=1)  # saved at 2, stopped
    second, _ = _run(tmp_path / "cut", 4, *LORA, init)
    assert min(second.losses) == 3
    assert {**first.losses, **second.losses} == full.losses

    _, _, loaded = load_model(tmp_path / "full" / "checkpoints" / "final")
    for name, bias in _biases(loaded).items():
        torch.testing.assert_close(bias, start[name], rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids), trainer.model.eval()(ids),
                                   rtol=0, atol=1e-5)


def test_an_adapter_checkpoint_on_a_hugging_face_base_loads_as_it_trained(tmp_path):
    """Qwen3-Next routes without a bias: its import leaves kiln's at its initial zero, and so
    must ``load_model`` (it once left the buffer as uninitialised memory, routing garbage)."""
    pytest.importorskip("transformers")
    from kiln.recipes.loading.hf_recipe import import_recipe
    from tests.checkpointing.huggingface.test_qwen3_next import _qwen3_next

    _qwen3_next(tmp_path / "hf")
    import_recipe(str(tmp_path / "hf"), tmp_path / "hf.toml", seq_len=128)
    keep = [o for o in TINY if not o.startswith(("--data.", "--training."))]
    recipe = load_recipe(tmp_path / "hf.toml", [
        *keep, *CHAT, "--training.steps=2", f"--run.folder={tmp_path / 'lora'}",
        "--checkpoint.enable=true", *LORA])
    trainer = Trainer(recipe, out=io.StringIO())
    trainer.fit()
    _, _, loaded = load_model(tmp_path / "lora" / "checkpoints" / "final")
    assert all(b.abs().sum() == 0 for b in _biases(loaded).values()), _biases(loaded)
    ids = torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids), trainer.model.eval()(ids),
                                   rtol=0, atol=1e-5)
