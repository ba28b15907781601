"""What the GRPO step builds from a rollout: per-completion seeds, replacement prompts, rewards
per group, and training rows whose labels are exactly the completion tokens."""

from __future__ import annotations

import types

import pytest

from kiln.components.base import default_config
from kiln.components.errors import DataError
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.steps import grpo_batch


def _sample(ids, text="", truncated=False):
    return types.SimpleNamespace(ids=ids, text=text, truncated=truncated,
                                 logprobs=[-0.5 - i for i in range(len(ids))])


def test_seeds_and_replacement_rows_depend_on_what_they_name_only():
    seeds = {grpo_batch.completion_seed(0, step, row, j)
             for step in (0, 1) for row in (5, 6) for j in (0, 1)}
    assert len(seeds) == 8 and grpo_batch.completion_seed(0, 1, 5, 0) in seeds
    assert grpo_batch.completion_seed(1, 0, 5, 0) not in seeds  # another run seed
    rows = [grpo_batch.refill_row(0, 3, slot, 0, 10) for slot in range(20)]
    assert all(0 <= r < 10 for r in rows) and len(set(rows)) > 1
    assert rows == [grpo_batch.refill_row(0, 3, slot, 0, 10) for slot in range(20)]


def test_training_rows_label_the_completion_and_carry_the_sampling_logprobs():
    prompts = [[1, 2, 3], [7]]
    samples = [_sample([4, 5]), _sample([8, 9, 10], truncated=True)]
    rows = grpo_batch.training_rows(prompts, samples, pad_id=0, device="cpu")
    assert rows.batch["input_ids"].tolist() == [[1, 2, 3, 4], [7, 8, 9, 0]]
    i = IGNORE_INDEX
    assert rows.batch["labels"].tolist() == [[i, i, 4, 5], [8, 9, 10, i]]
    assert rows.mask.tolist() == [[False, False, True, True], [True, True, True, False]]
    assert rows.sampled[0, 2:].tolist() == [-0.5, -1.5] and rows.sampled[1, :3].tolist() == \
        [-0.5, -1.5, -2.5]
    cut = grpo_batch.training_rows(prompts, samples, pad_id=0, device="cpu",
                                   drop_truncated=True)
    assert not cut.mask[1].any() and cut.mask[0].sum() == 2  # DAPO's overlong filtering
    assert cut.part(slice(1, 2)).batch["input_ids"].tolist() == [[7, 8, 9, 0]]


def test_rewards_per_completion_with_their_prompts_fields_and_weights():
    rewards = {"right": default_config("reward", "exact_match", extract="all").build(),
               "short": default_config("reward", "length", max_tokens=2, buffer=1).build()}
    samples = [_sample([1], "5"), _sample([1, 2, 3], "6"), _sample([1], "7"), _sample([1], "x")]
    values, total = grpo_batch.score(rewards, [1.0, 0.5], samples,
                                     [{"answer": "5"}, {"answer": "7"}], 2)
    assert values.tolist() == [[1.0, 0.0], [0.0, -1.0], [1.0, 0.0], [0.0, 0.0]]
    assert total.tolist() == [1.0, -0.5, 1.0, 0.0]


def test_a_reward_that_cannot_score_stops_with_one_line_naming_it():
    numeric = {"value": default_config("reward", "numeric").build()}
    with pytest.raises(DataError, match="rewards.value: the prompt's 'answer' is not a number"):
        grpo_batch.score(numeric, [1.0], [_sample([1], "3")], [{"answer": "many"}], 1)
    short = {"mine": lambda completions: [1.0]}  # a plugin's reward missing a score
    with pytest.raises(DataError, match="rewards.mine gave 1 scores for 2 completions"):
        grpo_batch.score(short, [1.0], [_sample([1]), _sample([2])], [{}, {}], 2)


def test_the_rollout_log_is_replaced_whole(tmp_path):
    path = tmp_path / "rollouts" / "step_0000001-rank0.jsonl"
    grpo_batch.write_log(path, [{"a": 1}])
    grpo_batch.write_log(path, [{"a": 2}, {"a": 3}])
    assert path.read_text() == '{"a": 2}\n{"a": 3}\n'
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
