"""A plugin written against the documented API of the release before the move (components.base,
components.registry, the Hook of kiln.recipes.hooks, a model without ModelContract, a dataset
without DatasetContract) still registers through its entry point and trains, with its hook
turned on by a [hooks.NAME] table."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kiln.components.protocols import Hook, ModelContract, complete_model
from kiln.recipes.config.files import load_recipe
from tests.components.test_registry import _make_dist
from tests.conftest import CONFIGS, REPO
from tests.recipes.training.test_trainer import TINY

PLUGIN = """
    import json
    import torch
    from pydantic import Field
    from torch import nn
    from kiln.components.base import ComponentConfig
    from kiln.components.registry import register
    from kiln.recipes.hooks import Hook          # the hook base's import path before the move

    class BigramConfig(ComponentConfig):
        dim: int = Field(16, description="width")

    @register("model", "plugin_bigram")
    class Bigram(nn.Module):
        '''A bigram model with none of the optional methods.'''
        Config = BigramConfig
        def __init__(self, cfg, *, vocab_size, seq_len):
            super().__init__()
            self.layers = nn.ModuleList([nn.Embedding(vocab_size, cfg.dim)])
            self.out = nn.Linear(cfg.dim, vocab_size)
        def forward(self, ids):
            return self.out(self.layers[0](ids))
        def blocks(self):
            return list(self.layers)
        def init_weights(self):
            for p in self.parameters():
                nn.init.normal_(p, std=0.02)
        def flops_per_token(self, seq_len):
            return 6.0 * sum(p.numel() for p in self.parameters())
        def num_params(self, exclude_embeddings=False):
            return sum(p.numel() for p in self.parameters())

    from kiln.components.data.packed_documents import PackedDocuments, PackedDocumentsConfig

    class TextConfig(ComponentConfig):
        max_bytes: int = Field(200000, description="stdlib text to read")

    @register("dataset", "plugin_text")
    class PluginText:
        '''The stdlib text through packed_documents, with none of the optional members.'''
        Config = TextConfig
        def __init__(self, cfg, *, tokenizer, seq_len, seed=0, **context):
            inner = PackedDocumentsConfig(type="packed_documents", max_bytes=cfg.max_bytes)
            self.inner = PackedDocuments(inner, tokenizer=tokenizer, seq_len=seq_len, seed=seed)
        def prepare(self, create=False):
            return self.inner.prepare(create=create)
        def loader(self, split, **kw):
            return self.inner.loader(split, **kw)

    class CountConfig(ComponentConfig):
        out: str = Field(description="where to write the counts")

    @register("hook", "plugin_count")
    class Count(Hook):
        '''Counts the steps it saw.'''
        Config = CountConfig
        def __init__(self, cfg):
            self.out, self.steps = cfg.out, []
        def on_step_end(self, trainer, result):
            self.steps.append(trainer.progress.step)
        def on_train_end(self, trainer):
            open(self.out, "w").write(json.dumps(self.steps))
"""


@pytest.mark.slow
def test_a_plugin_of_the_old_api_registers_and_trains_with_its_hook(tmp_path):
    _make_dist(tmp_path, "kiln-old-plugin", "kiln_old_plugin", PLUGIN)
    counts = tmp_path / "counts.json"
    tiny = [a for a in TINY if not a.startswith(("--model.", "--data."))]
    code = textwrap.dedent(f"""
        import sys, warnings
        sys.path.insert(0, {str(tmp_path)!r})
        from kiln.recipes.cli import main
        sys.exit(main(["train", {str(CONFIGS / "debug.toml")!r}, *{tiny!r},
                       "--model.type=plugin_bigram", "--model.dim=16",
                       "--data.type=plugin_text",  # a dataset without DatasetContract
                       "--hooks.count.type=plugin_count", "--hooks.count.out={counts}",
                       "--run.folder={tmp_path / 'run'}"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads(counts.read_text()) == [1, 2, 3, 4]
    assert "step      4/4" in out.stdout


def test_complete_model_gives_the_missing_optional_methods_their_defaults():
    import torch

    model = complete_model(torch.nn.Linear(2, 2))
    assert model.pop_aux_loss() is None and model.metrics() == {}
    assert model.carry_state() is None and model.resolve_kernels("cpu", torch.float32) == ""
    model.set_progress(1, 2)
    model.on_global_step(False)
    assert "weight" in model.state_dict() and len(model.state_dict()) == 2  # nothing added


def test_complete_dataset_gives_a_plugin_dataset_the_contracts_defaults():
    from kiln.components.protocols import DatasetContract, complete_dataset

    class Bare:
        def prepare(self, create=False):
            return None

    ds = complete_dataset(Bare())
    assert ds.source_names == () and ds.token_weighted is False and ds.template is None
    assert ds.check_run(10, 8) == [] and ds.describe() == "" and ds.fingerprints() == {}
    assert ds.stage_steps() == [] and ds.pin_stages([], 0, 10) == []
    assert ds.tokens_per_byte("eval") is None and dict(ds.meta) == {}

    class Own(DatasetContract):
        token_weighted = True

        def describe(self):
            return "mine"

    own = complete_dataset(Own())
    assert own.token_weighted and own.describe() == "mine" and own.check_run(1, 1) == []


def test_complete_step_gives_a_plugin_step_the_contracts_defaults():
    from kiln.components.protocols import complete_step

    class Bare:
        def __call__(self, ctx, micro_batches):
            return None

    step = complete_step(Bare())
    assert step.trains_mtp is True and step.takes_pairs == "" and step.scores == ()
    assert step.token_weighted is False and step.varying_width is False

    class Scoring(Bare):
        trains_mtp = False

    assert complete_step(Scoring()).trains_mtp is False


def test_a_model_keeps_its_own_optional_methods():
    import torch

    class Mine(ModelContract, torch.nn.Module):
        def metrics(self):
            return {"x": 1.0}

    assert complete_model(Mine()).metrics() == {"x": 1.0}


def test_hooks_run_by_priority_and_close_in_reverse():
    from kiln.recipes.training.hook_set import by_priority

    class A(Hook):
        priority = 5

    class B(Hook):
        priority = 50

    a, b, c = A(), B(), Hook()
    assert by_priority([c, a, b]) == [b, a, c]


@pytest.mark.parametrize("table, message", [
    ("[hooks.w]\ntype = \"watchdog\"", r"hooks.w.type = 'watchdog'.*\[run.watchdog\]"),
    ("[run.watchdog]\ntype = \"diagnostics\"", r"run.watchdog.type = 'diagnostics'"),
])
def test_kiln_s_own_hooks_are_set_in_run_and_nowhere_else(write, table, message):
    from kiln.components.errors import RecipeError

    recipe = write("r.toml", f'extends = "{CONFIGS / "debug.toml"}"\n{table}\n')
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe)
