"""The GRPO step in the trainer: TRL's metrics, the generator's log-probabilities equal the
training forward's, exact resume (rollouts regenerated identically), the rollout log, the KL
term with a frozen reference or LoRA off, several iterations, dynamic sampling; recipes it
cannot train are refused by ``train`` and ``validate`` alike."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kiln.components.errors import DataError, RecipeError
from kiln.components.steps import grpo_loss
from kiln.recipes.training.trainer import Trainer
from tests.components.steps import recorded_runs

DATA = ("--data.type=prompts", "--data.template=chatml", "--data.builtin_rows=64",
        "--data.eval_fraction=0.1", "--eval.interval=0", "--eval.at_end=false")
STEP = ("--training.step.type=grpo", "--training.step.group_size=4",
        "--training.step.rollout.max_new_tokens=8")
REWARDS = ("--rewards.op.type=exact_match", "--rewards.op.field=op",
           "--rewards.op.regex='([-+*])'", "--rewards.short.type=length",
           "--rewards.short.max_tokens=8", "--rewards.short.buffer=4")
PROMPTS = (*DATA, *STEP, *REWARDS)
TINY = ("--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
        "--model.ffn.hidden_dim=48", "--training.seq_len=160", "--training.global_batch=4",
        "--training.micro_batch=2", "--run.progress_bar=false", "--run.tensorboard=false",
        "--run.log_interval=1", "--optimizer.lr=1e-2", "--checkpoint.interval=2",
        "--model.tie_embeddings=false")
METRICS = {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
           "completions/clipped_ratio", "entropy", "clip_ratio/low_mean",
           "clip_ratio/high_mean", "clip_ratio/region_mean", "rewards/op/mean",
           "rewards/op/std", "rewards/short/mean", "rewards/short/std", "rollout/logp_diff"}


def _recipe(folder, *extra, steps=4, data=PROMPTS):
    return recorded_runs.recipe((*TINY, *data), folder, *extra, steps=steps)


def _run(folder, *extra, steps=4, data=PROMPTS):
    return recorded_runs.run((*TINY, *data), folder, *extra, steps=steps)


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo") / "run"
    return (*_run(folder, "--training.step.log_rollouts=2"), folder)


def test_logs_trls_metrics_and_the_rollouts(grpo):
    record, trainer, log, folder = grpo
    assert "prompt data: 58 train prompts, 6 held out" in log and "no KL term" in log
    assert set(record.metrics[1]) >= METRICS and "kl" not in record.metrics[1]
    m = record.metrics[4]
    assert -1 <= m["reward"] <= 1 and 0 <= m["frac_reward_zero_std"] <= 1
    assert 1 <= m["completions/mean_length"] <= 8
    # the generator's log-probabilities are the training forward's (fp32, same weights)
    assert all(record.metrics[s]["rollout/logp_diff"] < 1e-5 for s in record.metrics)
    assert "samples with" not in log  # whole-distribution sampling has nothing to say
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert all(set(x) >= METRICS for x in lines if "loss" in x)
    logged = sorted(p.name for p in (folder / "rollouts").iterdir())
    assert logged == ["step_0000002-rank0.jsonl", "step_0000004-rank0.jsonl"]
    rows = [json.loads(x) for x in (folder / "rollouts" / logged[0]).read_text().splitlines()]
    assert len(rows) == 4 * 4 and rows[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert set(rows[0]["rewards"]) == {"op", "short"} and "advantage" in rows[0]
    groups = [rows[i:i + 4] for i in range(0, 16, 4)]
    assert all(len({r["row"] for r in g}) == 1 for g in groups)
    for g in groups:  # advantages: the group's rewards centred (and scaled)
        assert sum(r["advantage"] for r in g) == pytest.approx(0, abs=1e-5)


def test_on_a_reward_the_samples_reach_the_mean_reward_rises(tmp_path):
    """From a random start, rewarding answers that begin with "1": within 25 steps most do."""
    record, *_ = _run(tmp_path / "rise", "--training.step.group_size=8",
                      "--training.step.rollout.max_new_tokens=4", "--rewards.one.type=format",
                      "--rewards.one.regex='^1'", steps=25, data=(*DATA, *STEP))
    rewards = [record.metrics[s]["reward"] for s in range(1, 26)]
    assert sum(rewards[:5]) / 5 < 0.1 and sum(rewards[-5:]) / 5 > 0.5, rewards


def test_a_killed_and_resumed_run_continues_exactly(grpo, tmp_path):
    whole = grpo[0]
    _run(tmp_path / "cut", steps=2)
    second, *_ = _run(tmp_path / "cut")
    assert set(second.loss) == {3, 4}
    assert {s: second.loss[s] for s in (3, 4)} == {s: whole.loss[s] for s in (3, 4)}
    assert {s: second.metrics[s] for s in (3, 4)} == {s: whole.metrics[s] for s in (3, 4)}


LORA = ("--adapter.rank=2", '--adapter.targets=["*.attention.wq", "output"]',
        "--adapter.allow_random_base=true", "--training.step.beta=0.1")


def test_kl_to_a_frozen_copy_equals_kl_to_the_policy_with_lora_off(tmp_path):
    off, trainer, log = _run(tmp_path / "off", *LORA, steps=2)
    copy, *_ = _run(tmp_path / "copy", *LORA, "--training.step.reference=frozen_copy", steps=2)
    assert "adapters_off" in log and trainer.step_fn.reference is None
    assert off.loss == pytest.approx(copy.loss, rel=1e-6)
    assert off.metrics[1]["kl"] == pytest.approx(0, abs=1e-9)  # B = 0: the base at first
    assert off.metrics[2]["kl"] > 0


def test_each_groups_prompt_computed_once_gives_the_losses_of_whole_rows(tmp_path,
                                                                        monkeypatch):
    """share_prompts (the default): a group's rows packed around their prompt in the policy's
    training forward and the reference's (beta > 0); losses and metrics those of whole rows."""
    shared, log, layouts, whole = recorded_runs.shared_and_whole(
        (*TINY, *PROMPTS), tmp_path, monkeypatch, "--training.step.beta=0.1")
    assert "each group's prompt computed once per training forward" in log
    used = [x for x in layouts if x is not None]
    assert len(used) == 2 * 2 * 2  # 2 steps x 2 micro-batches x policy and reference
    assert all(x.members == 4 for x in used)
    for s in (1, 2):
        assert shared.loss[s] == pytest.approx(whole.loss[s], rel=1e-4, abs=1e-6)
        for key in ("kl", "entropy", "rollout/logp_diff", "reward"):
            assert shared.metrics[s][key] == pytest.approx(whole.metrics[s][key], rel=1e-4,
                                                           abs=1e-6), key


def test_a_second_iteration_on_the_same_rollouts_moves_and_clips_the_ratio(tmp_path):
    record, *_ = _run(tmp_path / "mu", "--training.step.iterations=2",
                      "--training.step.epsilon=0.001", steps=1)
    assert record.metrics[1]["clip_ratio/region_mean"] > 0
    once, *_ = _run(tmp_path / "once", "--training.step.epsilon=0.001", steps=1)
    assert once.metrics[1]["clip_ratio/region_mean"] == 0  # one iteration: the ratio is 1


@pytest.mark.parametrize("mode", ["token", "constant"])
def test_other_aggregations_and_batch_scaling_train(tmp_path, mode):
    record, *_ = _run(tmp_path / mode, f"--training.step.loss_aggregation={mode}",
                      "--training.step.scale_rewards=batch",
                      "--training.step.dynamic_sampling=true",
                      "--training.step.overlong_filter=true", steps=2)
    assert all(torch.isfinite(torch.tensor(v)) for v in record.loss.values())


def test_dynamic_sampling_refills_groups_whose_rewards_are_all_equal(tmp_path):
    base, *_ = _run(tmp_path / "plain", steps=2)
    record, *_ = _run(tmp_path / "dyn", "--training.step.dynamic_sampling=true",
                      "--training.step.refill_rounds=3", steps=2)
    assert sum(record.metrics[s]["refilled_groups"] for s in (1, 2)) > 0
    assert record.metrics[1]["frac_reward_zero_std"] < base.metrics[1]["frac_reward_zero_std"]
    again, *_ = _run(tmp_path / "again", "--training.step.dynamic_sampling=true",
                     "--training.step.refill_rounds=3", steps=2)
    assert again.loss == record.loss and again.metrics == record.metrics


def test_a_group_whose_rewards_are_all_equal_gets_no_gradient():
    logp = torch.randn(4, 5, requires_grad=True)
    adv, zero = grpo_loss.group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, "group")
    assert zero.tolist() == [True, True, False, False] and adv[:2].tolist() == [0, 0]
    mask = torch.ones(4, 5, dtype=torch.bool) & ~zero[:, None]  # dynamic sampling
    terms = grpo_loss.token_terms(logp, logp.detach(), adv, epsilon=0.2, epsilon_high=0.2)
    grpo_loss.aggregate(terms.loss, mask, "token", completions=2, tokens=10,
                        max_new_tokens=5).backward()
    assert logp.grad[:2].abs().sum() == 0 and logp.grad[2:].abs().sum() > 0


@pytest.mark.parametrize("extra, data, message", [
    ((), (*DATA, *STEP), "needs at least one reward"),
    (("--eval.interval=2",), PROMPTS, "no held-out loss"),
    (("--training.step.beta=0.1", "--training.step.reference=none"), PROMPTS,
     "beta > 0 needs a reference"),
    (("--training.step.type=standard",), DATA, "holds prompts to sample from"),
    # a step taking preference pairs was told it "samples completions of prompts"
    (("--training.step.type=preference",), DATA, r"'prompts' holds prompts to sample from, "
     r"which training.step.type = 'preference' cannot train on; use training.step.type = "
     r"\"grpo\" \(or data.type = \"preference\" for the paired rows it takes\)"),
    ((), ("--data.type=chat", "--data.template=chatml", "--data.builtin_rows=60",
          "--training.step.type=grpo", "--rewards.op.type=format", "--rewards.op.regex='x'",
          "--eval.interval=0", "--eval.at_end=false"), "samples completions of prompts"),
    (("--rewards.op.extract=regex", "--rewards.op.regex=''"), PROMPTS,
     "rewards.op: extract = \"regex\" needs a regex"),
])
def test_train_and_validate_refuse_the_same_recipes(tmp_path, extra, data, message):
    _refused(tmp_path, extra, data, message, RecipeError)


@pytest.mark.parametrize("extra, message", [
    (("--rewards.op.field=missing",), "rewards.op reads the prompts' field 'missing', which "
     r"no prompt has \(every prompt has: a, answer, b, op, restated\)"),
    (("--training.step.rollout.max_new_tokens=100",), "does not fit training.seq_len"),
    (("--training.seq_len=64",), "longer than training.seq_len = 64"),
    (("--rewards.n.type=numeric", "--rewards.n.field=op"),
     r"rewards.n cannot score built-in prompt set: row \d+ \(the prompt's 'op' is not a "
     "number"),
])
def test_bad_data_for_the_step_is_refused_by_train_and_validate(tmp_path, extra, message):
    _refused(tmp_path, extra, PROMPTS, message, DataError)


@pytest.mark.parametrize("held_out", ["0", "0.1"])
def test_a_numeric_reward_on_numbers_passes_every_prompt_of_both_splits(tmp_path, monkeypatch,
                                                                        held_out):
    from kiln.components.rewards.builtin import NumericReward
    from kiln.recipes.commands.validate import describe

    seen = []
    check = NumericReward.check
    monkeypatch.setattr(NumericReward, "check", lambda self, f: seen.append(f) or check(self, f))
    recipe = _recipe(tmp_path / "run", "--rewards.n.type=numeric", "--rewards.n.field=a",
                     f"--data.eval_fraction={held_out}")
    assert "fields: a, answer" in describe(recipe)
    assert len(seen) == 64  # data.builtin_rows: the training and the held-out prompts


def _refused(tmp_path, extra, data, message, error):
    from kiln.recipes.commands.validate import describe

    recipe = _recipe(tmp_path / "run", *extra, data=data)
    with pytest.raises(error, match=message):
        describe(recipe)
    with pytest.raises(error, match=message):
        Trainer(recipe, out=io.StringIO())
    assert not (tmp_path / "run").exists()


def test_group_size_one_is_refused_naming_the_key(tmp_path):
    with pytest.raises(RecipeError, match="group_size"):
        _recipe(tmp_path / "run", "--training.step.group_size=1")


def test_truncated_sampling_is_said_and_trained_on_the_whole_distribution(tmp_path):
    """top_p / top_k cut what the rollout draws from; the update's log-probabilities (and
    logp_diff) are the whole temperature-scaled distribution's, as TRL's, and the log says so."""
    record, _, log = _run(tmp_path / "run", "--training.step.rollout.top_p=0.9",
                          "--training.step.rollout.top_k=5", steps=1)
    assert "step: grpo samples with top_p = 0.9, top_k = 5; the ratio, KL, entropy and " \
           "rollout/logp_diff use the whole distribution" in log
    assert record.metrics[1]["rollout/logp_diff"] < 1e-5
