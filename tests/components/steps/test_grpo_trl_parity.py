"""The GRPO objective against TRL 1.16's ``GRPOTrainer._compute_loss`` on the same model,
prompts, completions, advantages, old and reference log-probabilities (fp32, temperature 0.8):
the loss, every weight's gradient, the KL and the clip fractions equal TRL's within 1e-5 for
each aggregation (GRPO's ``sequence``, DAPO's ``token``, Dr. GRPO's ``constant``), on a tiny
Llama built in the test and imported into kiln. The group advantages equal TRL's formula (its
``nanstd``) for each reward scaling."""

from __future__ import annotations

import pytest
import torch

from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.models.token_logprobs import LogprobHead
from kiln.components.steps import grpo_loss
from tests.checkpointing.huggingface.hf_tiny import kiln_from_hf, save_tiny
from tests.components.steps.hf_grads import hf_grads

trl = pytest.importorskip("trl")
TOL = dict(rtol=1e-5, atol=1e-5)
PROMPT, NEW, TEMPERATURE = 4, 7, 0.8
MODES = {"sequence": "grpo", "token": "dapo", "constant": "dr_grpo"}


def _inputs():
    """TRL's inputs for 4 completions of 2 prompts (left-padded prompts, right-padded
    completions of unequal length), and kiln's rows of the same tokens."""
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, 256, (4, PROMPT), generator=g)
    prompts[2:] = prompts[0]  # a group shares its prompt (not needed by the loss; realistic)
    completion = torch.randint(0, 256, (4, NEW), generator=g)
    lengths = torch.tensor([7, 3, 5, 1])
    mask = (torch.arange(NEW) < lengths[:, None]).long()
    rows = torch.cat([prompts, completion], 1)
    labels = torch.where(torch.cat([torch.zeros(4, PROMPT, dtype=torch.long), mask], 1)[:, 1:]
                         .bool(), rows[:, 1:], IGNORE_INDEX)
    hf = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts),
          "completion_ids": completion, "completion_mask": mask}
    return hf, rows[:, :-1], labels, mask


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("grpo")
    save_tiny(root / "policy", "llama", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(root / "policy", dtype=torch.float32)
    words = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t257",
                                        pad_token="t258", bos_token="t256")
    prompts = Dataset.from_list([{"prompt": "t1 t2"}] * 4)
    return hf, tokenizer, prompts, kiln_from_hf(root / "policy"), root


def _trainer(setup, mode: str, beta: float, correction: bool):
    hf, tokenizer, prompts, _, root = setup
    args = trl.GRPOConfig(output_dir=str(root / f"out-{mode}"), report_to="none", use_cpu=True,
                          bf16=False, loss_type=MODES[mode], beta=beta, epsilon=0.2,
                          epsilon_high=0.28, temperature=TEMPERATURE, num_generations=2,
                          per_device_train_batch_size=4, max_completion_length=NEW,
                          use_bias_correction_kl=correction)
    trainer = trl.GRPOTrainer(model=hf, reward_funcs=lambda completions, **kw: [0.0] *
                              len(completions), args=args, train_dataset=prompts,
                              processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("beta", "correction"), [(0.0, True), (0.04, True), (0.04, False)])
def test_loss_gradients_and_metrics_equal_trl(setup, mode, beta, correction):
    hf_model, _, _, kiln, root = setup
    hf_in, ids, labels, mask = _inputs()
    g = torch.Generator().manual_seed(11)
    advantages = torch.tensor([1.2, -0.7, 0.4, -0.9])
    with torch.no_grad():  # old and reference log-probs near the policy's: ratios clip a little
        base = kiln(ids, head=LogprobHead(labels, 5, TEMPERATURE))[:, PROMPT - 1:]
    old = (base + 0.3 * torch.randn(base.shape, generator=g)) * mask
    ref = (base + 0.2 * torch.randn(base.shape, generator=g)) * mask
    trainer = _trainer(setup, mode, beta, correction)
    hf_model.train()  # TRL's training mode (its metrics under "train"); no dropout here
    hf_model.zero_grad()
    loss = trainer._compute_loss(hf_model, {
        **hf_in, "advantages": advantages, "old_per_token_logps": old,
        "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()})
    loss.backward()
    theirs = trainer._metrics["train"]

    kiln.zero_grad()
    logp = kiln(ids, head=LogprobHead(labels, 5, TEMPERATURE))[:, PROMPT - 1:]  # chunked
    terms = grpo_loss.token_terms(logp, old, advantages, epsilon=0.2, epsilon_high=0.28,
                                  beta=beta, ref=ref if beta else None, kl_correction=correction)
    mine = grpo_loss.aggregate(terms.loss, mask.bool(), mode, completions=4.0,
                               tokens=float(mask.sum()), max_new_tokens=NEW)
    mine.backward()
    torch.testing.assert_close(mine, loss.detach(), **TOL)
    m = mask.bool()
    for name, mine_value in (("clip_ratio/low_mean", terms.low_clipped[m].float().mean()),
                             ("clip_ratio/high_mean", terms.high_clipped[m].float().mean())):
        assert theirs[name][-1] == pytest.approx(float(mine_value), abs=1e-6)
    assert theirs["clip_ratio/low_mean"][-1] + theirs["clip_ratio/high_mean"][-1] > 0
    if beta:
        assert theirs["kl"][-1] == pytest.approx(float(terms.kl[m].mean()), rel=1e-5)
    grads = {n: p.grad for n, p in hf_model.named_parameters()}
    kiln_grads = hf_grads(kiln, root / f"grads-{mode}-{beta}-{correction}")
    assert set(kiln_grads) == set(grads)
    for name, grad in kiln_grads.items():
        torch.testing.assert_close(grad, grads[name], **TOL, msg=name)




@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_formula(scale):
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    mean = rewards.view(-1, 4).mean(1).repeat_interleave(4)
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4) if scale != "batch" \
        else nanstd(rewards).expand_as(rewards)
    want = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
    got, zero = grpo_loss.group_advantages(rewards, 4, scale, batch_std=nanstd(rewards))
    torch.testing.assert_close(got, want, **TOL)
    assert zero.tolist() == [False] * 8 + [True] * 4  # the last group: every reward equal
