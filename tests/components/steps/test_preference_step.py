"""The preference step in the trainer: DPO starts at log 2 (the policy is its reference), logs
TRL's metrics in training and on the held-out pairs, resumes exactly, uses the policy with its
adapters off as the reference without a second copy (the same losses as a frozen copy), runs
the reference-free losses without one; recipes it cannot train are refused by ``train`` and
``validate`` alike."""

from __future__ import annotations

import io
import json
import math
import types

import pytest
import torch

from kiln.components.errors import RecipeError
from kiln.recipes.training.trainer import Trainer
from tests.components.steps import recorded_runs

PAIRS = ("--data.type=preference", "--data.template=chatml", "--data.builtin_rows=120",
         "--data.eval_fraction=0.1", "--training.step.type=preference")
TINY = ("--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
        "--model.ffn.hidden_dim=48", "--training.seq_len=128", "--training.global_batch=4",
        "--training.micro_batch=2", "--run.progress_bar=false", "--run.tensorboard=false",
        "--eval.interval=2", "--eval.tokens=512", "--eval.at_end=false", "--run.log_interval=1",
        "--optimizer.lr=1e-2", "--checkpoint.interval=2", "--model.tie_embeddings=false")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


def _recipe(folder, *extra, steps=4, data=PAIRS):
    return recorded_runs.recipe((*TINY, *data), folder, *extra, steps=steps)


def _run(folder, *extra, steps=4, data=PAIRS):
    return recorded_runs.run((*TINY, *data), folder, *extra, steps=steps)


def _lines(folder):
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo") / "run"
    return (*_run(folder), folder)


def test_dpo_starts_at_log_2_and_logs_trls_metrics(dpo):
    record, trainer, log, folder = dpo
    assert "reference = frozen_copy" in log and "preference data:" in log
    assert "eval  step 4  logps/chosen " in log and " rewards/accuracies " in log
    assert record.loss[1] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference
    assert record.metrics[1]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert set(METRICS) <= set(record.metrics[4])
    lines = _lines(folder)
    train = [x for x in lines if "loss" in x]
    assert all(set(METRICS) <= set(x) for x in train)
    assert train[0]["tokens_seen"] == 2 * 4 * 128  # both sides of 4 pairs
    held_out = [x for x in lines if "eval/rewards/accuracies" in x]
    assert [x["step"] for x in held_out] == [2, 4]
    assert all(0 <= x["eval/rewards/accuracies"] <= 1 for x in held_out)
    assert {f"eval/{m}" for m in METRICS} <= set(held_out[0])
    # every held-out pair's outcome is kept, so kiln compare pairs two runs pair by pair
    from kiln.recipes.runs import unit_scores

    values, columns = unit_scores.load(folder, "rewards", 4)
    assert columns == ["accuracies"] and len(values) == held_out[-1]["eval/rewards/examples"]
    assert values[:, 0].mean() == pytest.approx(held_out[-1]["eval/rewards/accuracies"])


def test_mfu_counts_the_tokens_the_forwards_ran(dpo):
    """Padding cut, prompts once, the reference's forward a third: fewer than the data's tokens
    (both sides of 4 pairs of 128, a third more with the reference), and the logged MFU is
    taken from them (one line per step)."""
    record, trainer, _, folder = dpo
    lines = [x for x in _lines(folder) if "mfu" in x]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    for line in lines:
        ran = record.flop_tokens[line["step"]]
        assert 0 < ran < 2 * 4 * 128 and line["flop_tokens"] == pytest.approx(ran)
        achieved = line["mfu"] * line["mfu_peak_tflops"] * 1e12 * line["interval_s"]
        assert achieved == pytest.approx(trainer.flops_per_token * ran, rel=1e-6)


def test_on_the_same_pairs_again_and_again_the_loss_falls_and_every_pair_is_ranked(tmp_path):
    record, *_ = _run(tmp_path / "same", "--data.builtin_rows=10", "--data.eval_fraction=0.2",
                      "--training.global_batch=8", "--training.micro_batch=4",
                      "--eval.interval=0", steps=10)
    losses = [record.loss[s] for s in range(1, 11)]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.9 * math.log(2) and record.metrics[10]["rewards/accuracies"] == 1.0


def test_a_killed_and_resumed_run_continues_exactly(dpo, tmp_path):
    whole = dpo[0]
    _run(tmp_path / "cut", steps=2)
    second, trainer, _ = _run(tmp_path / "cut")
    assert set(second.loss) == {3, 4}
    assert {s: second.loss[s] for s in (3, 4)} == {s: whole.loss[s] for s in (3, 4)}
    assert {s: second.metrics[s] for s in (3, 4)} == {s: whole.metrics[s] for s in (3, 4)}


def _held_bytes(trainer) -> int:
    """Bytes of every distinct parameter the trainer's models hold (policy and reference)."""
    models = [trainer.model, trainer.step_fn.reference]
    tensors = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
               for m in models if m is not None for p in m.parameters()}
    return sum(tensors.values())


def test_with_lora_the_reference_is_the_policy_without_adapters_and_no_copy(tmp_path):
    """adapters_off (``auto`` with an adapter) equals a frozen copy of the base, with no
    second copy of the weights (measured: the parameter bytes held)."""
    lora = ("--adapter.rank=2", '--adapter.targets=["*.attention.wq", "output"]',
            "--adapter.allow_random_base=true")
    off, trainer_off, log = _run(tmp_path / "off", *lora)
    copy, trainer_copy, _ = _run(tmp_path / "copy", *lora, "--training.step.reference=frozen_copy")
    assert "reference = adapters_off" in log and trainer_off.step_fn.reference is None
    assert off.loss == copy.loss and off.metrics == copy.metrics
    assert off.loss[1] == pytest.approx(math.log(2), abs=1e-6)  # B = 0: the base at first
    base = sum(p.numel() * p.element_size() for n, p in trainer_off.model.named_parameters()
               if "lora" not in n)
    assert _held_bytes(trainer_copy) - _held_bytes(trainer_off) == base


def test_with_dora_the_adapters_off_reference_equals_a_frozen_copy_too(tmp_path):
    dora = ("--adapter.type=dora", "--adapter.rank=2", "--adapter.allow_random_base=true",
            '--adapter.targets=["*.feed_forward.w2", "*.attention.wo"]')
    off, trainer, log = _run(tmp_path / "off", *dora, steps=3)
    copy, *_ = _run(tmp_path / "copy", *dora, "--training.step.reference=frozen_copy", steps=3)
    assert "reference = adapters_off" in log and trainer.step_fn.reference is None
    assert off.loss == pytest.approx(copy.loss, rel=1e-6) and off.loss[3] != off.loss[1]


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_build_no_reference(tmp_path, loss):
    record, trainer, log = _run(tmp_path / loss, f"--training.step.loss.type={loss}",
                                "--training.step.reference=frozen_copy",
                                "--training.step.precompute_reference=true", steps=2)
    assert trainer.step_fn.reference is None and trainer.step_fn.adapters_off is None
    assert f"warning: training.step.loss.type = '{loss}' is reference-free; training.step." \
        "reference = 'frozen_copy' and training.step.precompute_reference not used" in log
    assert not (tmp_path / loss / "reference_logps.safetensors").exists()
    assert all(math.isfinite(v) for v in record.loss.values())
    if loss == "orpo":
        assert "nll_loss" in record.metrics[2] and "log_odds_ratio" in record.metrics[2]


@pytest.mark.parametrize("extra, data, message", [
    (("--training.step.type=standard",), PAIRS,
     "holds preference pairs .* training.step.type = 'standard' would train on as plain"),
    ((), ("--data.type=chat", "--data.template=chatml", "--data.builtin_rows=60",
          "--training.step.type=preference"),
     "trains on preference pairs, and data.type = 'chat' has none"),
    (("--training.step.reference=none",), PAIRS, "'dpo' needs a reference model"),
    (("--training.step.reference=adapters_off",), PAIRS, "adapters_off\" needs an \\[adapter\\]"),
])
def test_train_and_validate_refuse_the_same_recipes(tmp_path, extra, data, message):
    from kiln.recipes.commands.validate import describe

    recipe = _recipe(tmp_path / "run", *extra, data=data)
    with pytest.raises(RecipeError, match=message):
        describe(recipe)
    with pytest.raises(RecipeError, match=message):
        Trainer(recipe, out=io.StringIO())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dim, why", [("tp", "vocabulary-sharded"), ("cp", "part of each"),
                                      ("pp", "last stage")])
def test_parallelisms_that_split_a_sequence_or_its_logits_are_refused(tmp_path, dim, why):
    recipe = _recipe(tmp_path / "run")
    step = recipe.training.step.build()
    layout = types.SimpleNamespace(**{"tp": 1, "cp": 1, "pp": 1, dim: 2})
    with pytest.raises(RecipeError, match=f"parallelism.{dim} > 1 .*{why}"):
        step.check_recipe(recipe, layout)


def test_the_reference_forward_runs_without_gradients_or_dropout(tmp_path):
    """With dropout in the model, the frozen reference and the adapters-off reference are
    deterministic (eval mode), and no reference parameter gets a gradient."""
    record, trainer, _ = _run(tmp_path / "drop", "--model.dropout=0.2", steps=2)
    assert all(p.grad is None for p in trainer.step_fn.reference.parameters())
    assert not trainer.step_fn.reference.training
    batch = trainer.to_device(next(iter(trainer.dataset.loader(
        "eval", micro_batch=2, global_batch=2))))
    first = trainer.step_fn.reference_logprobs(trainer.step_context, batch)
    assert torch.equal(first, trainer.step_fn.reference_logprobs(trainer.step_context, batch))


@pytest.mark.slow
def test_under_torch_compile_and_activation_checkpointing_the_losses_are_the_same(dpo, tmp_path):
    """aot_eager: the blocks trace forward and backward with the reference's no_grad forward
    beside them (inductor's kernels are test_compile's subject); no evaluation (it would
    compile the blocks again for no_grad)."""
    whole = dpo[0]
    compiled, *_ = _run(tmp_path / "compiled", "--parallelism.compile=true",
                        "--parallelism.compile_backend=aot_eager", "--eval.interval=0",
                        "--parallelism.activation_checkpoint=full", steps=3)
    assert [compiled.loss[s] for s in (1, 2, 3)] == pytest.approx(
        [whole.loss[s] for s in (1, 2, 3)], rel=1e-5)


def test_a_lora_dpo_run_exports_merged_and_as_peft(tmp_path):
    from kiln.components.models.block import padded_vocab
    from kiln.recipes.cli import main
    from kiln.recipes.inference.saved_model import export_checkpoint
    from tests.components.adapters.test_lora import _save

    base = _recipe(tmp_path / "b", data=())
    torch.manual_seed(7)
    model = base.model.build(vocab_size=padded_vocab(base.model, 258), seq_len=128)
    export_checkpoint(_save(tmp_path / "base", model, base), tmp_path / "hf")
    _, trainer, log = _run(tmp_path / "lora", "--adapter.rank=2",
                           f"--checkpoint.init_from={tmp_path / 'hf'}", steps=2)
    assert "reference = adapters_off" in log
    final = tmp_path / "lora" / "checkpoints" / "final"
    assert main(["export", str(final), str(tmp_path / "merged")]) == 0
    assert main(["export", str(final), str(tmp_path / "peft"), "--format", "peft"]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2


def test_a_precomputed_reference_gives_the_same_losses_with_no_reference_forward(dpo, tmp_path):
    """The reference's log-probabilities computed once (in other batch shapes: equal to
    float rounding) and stored in the run folder; no frozen copy is held and training runs no
    reference forward (counted); a resume reads the file and computes nothing."""
    from kiln.components.steps.reference_table import FILE

    whole = dpo[0]
    pre = ("--training.step.precompute_reference=true",
           "--training.step.precompute_micro_batch=3")
    record, trainer, log = _run(tmp_path / "pre", *pre)
    assert "computed once (108 train, 12 eval pairs)" in log
    assert trainer.step_fn.reference is None and trainer.step_fn.uses == "precomputed"
    assert trainer.step_fn.reference_forwards == 0
    assert [record.loss[s] for s in range(1, 5)] == pytest.approx(
        [whole.loss[s] for s in range(1, 5)], rel=1e-5)
    file = tmp_path / "pre" / FILE
    stamp = file.stat().st_mtime_ns
    _run(tmp_path / "cut", *pre, steps=2)
    second, trainer, log = _run(tmp_path / "cut", *pre)
    assert f"log-probabilities from {tmp_path / 'cut' / FILE}" in log
    assert "a frozen model" not in log  # the resume builds no reference at all
    assert trainer.step_fn.reference_forwards == 0 and file.stat().st_mtime_ns == stamp
    assert {s: second.loss[s] for s in (3, 4)} == {s: record.loss[s] for s in (3, 4)}


def test_each_pairs_prompt_computed_once_gives_the_losses_of_whole_rows(tmp_path,
                                                                       monkeypatch):
    """share_prompts (the default): the pairs' rows packed around their prompt, in the policy's
    forward and the reference's; the losses and metrics those of whole rows."""
    shared, log, layouts, whole = recorded_runs.shared_and_whole(
        (*TINY, *PAIRS), tmp_path, monkeypatch, "--eval.interval=0")
    assert "each pair's prompt computed once per forward" in log
    used = [x for x in layouts if x is not None]
    assert len(used) == 2 * 2 * 2  # 2 steps x 2 micro-batches x policy and reference
    assert all(x.members == 2 and x.prefix >= 128 / 8 for x in used)
    for s in (1, 2):
        assert shared.loss[s] == pytest.approx(whole.loss[s], rel=1e-5)
        for key in METRICS:
            assert shared.metrics[s][key] == pytest.approx(whole.metrics[s][key], rel=1e-4,
                                                           abs=1e-6), key


def test_a_policy_with_dropout_runs_its_pairs_whole_and_says_why(tmp_path):
    _, _, log = _run(tmp_path / "run", "--model.attention.dropout=0.1", "--eval.interval=0",
                     steps=1)
    assert "share_prompts: the pairs run whole" in log and "dropout" in log


def test_a_stored_reference_for_other_data_is_refused(tmp_path):
    from kiln.components.errors import CheckpointError

    pre = ("--training.step.precompute_reference=true",)
    _run(tmp_path / "run", *pre, steps=2)
    with pytest.raises(CheckpointError, match="computed for other data"):
        Trainer(_recipe(tmp_path / "run", *pre, "--data.builtin_rows=100"), out=io.StringIO())


def test_kto_on_unpaired_examples_logs_trls_kto_metrics_and_refuses_pairs(tmp_path):
    from tests.recipes.test_combinations import PAIRS as FILES

    unpaired = ("--data.type=preference", f"--data.path={FILES / 'sums_unpaired.jsonl'}",
                f"--data.template={FILES / 'plain.jinja'}", "--data.eval_fraction=0.2",
                "--training.step.type=preference", "--training.step.loss.type=kto")
    record, trainer, log = _run(tmp_path / "kto", "--training.seq_len=16", steps=3,
                                data=unpaired)
    assert "unpaired (KTO): 32 train examples" in log and "eval  step 2  kl " in log
    assert record.loss[1] == pytest.approx(0.5, abs=1e-6)  # 1 - sigmoid(0): the reference
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "kl",
            "desirable_share"} <= set(record.metrics[3])
    with pytest.raises(RecipeError, match="holds unpaired examples and training.step.loss"):
        Trainer(_recipe(tmp_path / "dpo", "--training.seq_len=16",
                        data=unpaired[:-1]), out=io.StringIO())
    with pytest.raises(RecipeError, match="holds paired examples and .* 'kto' takes unpaired"):
        Trainer(_recipe(tmp_path / "kto2", "--training.step.loss.type=kto"), out=io.StringIO())


def test_multi_token_prediction_modules_are_said_to_keep_their_weights(tmp_path):
    """The preference loss scores the main head: a model's MTP modules get no gradient (the
    log says so) while the rest trains."""
    record, trainer, log = _run(tmp_path / "run", "--model.mtp_depth=1", steps=1)
    assert "step: preference trains the main head only; the multi-token prediction modules " \
           "keep their weights" in log
    named = dict(trainer.model.named_parameters())
    assert all(named[n].grad is None for n in named if n.startswith("mtp."))
    assert any(named[n].grad is not None for n in named if not n.startswith("mtp."))
    model = trainer.model  # MFU counts the trunk that ran
    assert trainer.flops_per_token == model.flops_per_token(128, mtp=False) \
        < model.flops_per_token(128)
    _, standard, plain = _run(tmp_path / "plain", "--model.mtp_depth=1", steps=1,
                       data=("--data.type=packed_documents",))
    assert "main head only" not in plain  # the standard step trains them
    assert standard.flops_per_token == standard.model.flops_per_token(128)
