"""The preference losses against TRL 1.16 on the same model, batch and reference (fp32): the
loss, the chosen / rejected rewards and every weight's gradient equal ``DPOTrainer``'s within
1e-5 for DPO, IPO, hinge and DPO + NLL, and ``KTOTrainer``'s for KTO (its KL term too), on a
tiny Llama built in the test and imported into kiln (its gradients exported back to Hugging
Face names). SimPO and ORPO are checked against ``CPOTrainer.cpo_loss`` and
``ORPOTrainer.odds_ratio_loss`` on the same sequence log-probabilities (value, rewards and
gradients)."""

from __future__ import annotations

import types

import pytest
import torch

from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.models.token_logprobs import LogprobHead
from kiln.components.steps.preference_losses import (
    DPO,
    IPO,
    ORPO,
    BetaConfig,
    DPOConfig,
    Hinge,
    PairLogps,
    ReferenceFreeConfig,
    SimPO,
    SimPOConfig,
)
from tests.checkpointing.huggingface.hf_tiny import kiln_from_hf, save_tiny
from tests.components.steps.hf_grads import hf_grads

trl = pytest.importorskip("trl")
TOL = dict(rtol=1e-5, atol=1e-5)
PROMPT, WIDTH = 5, 14  # tokens of the shared prompt; of every padded row


def _batch():
    """(HF inputs with TRL's completion mask, kiln's batch): 2 pairs, chosen rows then
    rejected rows; the sides share the prompt and differ in completion and length."""
    g = torch.Generator().manual_seed(3)
    rows, mask = torch.full((4, WIDTH), 258), torch.zeros(4, WIDTH, dtype=torch.long)
    lengths = [PROMPT + 6, PROMPT + 9, PROMPT + 4, PROMPT + 8]  # chosen 0, 1; rejected 0, 1
    prompts = torch.randint(0, 256, (2, PROMPT), generator=g)
    for r, n in enumerate(lengths):
        rows[r, :PROMPT] = prompts[r % 2]
        rows[r, PROMPT:n] = torch.randint(0, 256, (n - PROMPT,), generator=g)
        mask[r, PROMPT:n] = 1
    attention = (torch.arange(WIDTH) < torch.tensor(lengths)[:, None]).long()
    hf = {"input_ids": rows, "attention_mask": attention, "completion_mask": mask}
    labels = torch.where(mask[:, 1:].bool(), rows[:, 1:], IGNORE_INDEX)
    return hf, {"input_ids": rows[:, :-1], "labels": labels}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF policy, HF reference, the TRL trainer over them, kiln policy, kiln reference)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("trl")
    for name, seed in (("policy", 0), ("ref", 1)):
        save_tiny(root / name, "llama", seed=seed)
    hf = [AutoModelForCausalLM.from_pretrained(root / n, dtype=torch.float32)
          for n in ("policy", "ref")]
    words = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t257",
                                        pad_token="t258", bos_token="t256")
    pairs = Dataset.from_list([{"prompt": "t1 t2", "chosen": "t3", "rejected": "t4"}] * 2)
    args = trl.DPOConfig(output_dir=str(root / "out"), report_to="none", use_cpu=True,
                         bf16=False)  # (its default: bf16 autocast, also on the CPU)
    trainer = trl.DPOTrainer(model=hf[0], ref_model=hf[1], args=args, train_dataset=pairs,
                             processing_class=tokenizer)
    kiln = [kiln_from_hf(root / n) for n in ("policy", "ref")]
    return hf[0], trainer, kiln[0], kiln[1], root


def _kiln_logps(policy, reference, batch, n=2) -> PairLogps:
    labels = batch["labels"]
    mine = policy(batch["input_ids"], head=LogprobHead(labels, 5))  # chunked: 5 tokens
    with torch.no_grad():
        ref = reference(batch["input_ids"], head=LogprobHead(labels, 5)).sum(-1)
    seq, counts = mine.sum(-1), (labels != IGNORE_INDEX).sum(-1).float()
    return PairLogps(seq[:n], seq[n:], counts[:n], counts[n:], ref[:n], ref[n:])


def _trl_step(trainer, hf_policy, inputs):
    """TRL's loss of ``inputs`` (its backward run into ``hf_policy``) and its logged metrics."""
    trainer._metrics["train"].clear()
    hf_policy.train()
    hf_policy.zero_grad()
    loss = trainer._compute_loss(hf_policy, inputs, False)
    loss.backward()
    return loss.detach(), trainer._metrics["train"]




@pytest.mark.parametrize("loss_types, weights, build", [
    (["sigmoid"], [1.0], lambda: DPO(DPOConfig(type="dpo", beta=0.3))),
    (["ipo"], [1.0], lambda: IPO(BetaConfig(type="ipo", beta=0.3))),
    (["hinge"], [1.0], lambda: Hinge(BetaConfig(type="hinge", beta=0.3))),
    # RPO: DPO plus the chosen completions' NLL
    (["sigmoid", "sft"], [1.0, 0.7], lambda: DPO(DPOConfig(type="dpo", beta=0.3,
                                                           sft_weight=0.7))),
], ids=["dpo", "ipo", "hinge", "dpo_sft"])
def test_loss_rewards_and_gradients_equal_trl_dpo_trainer(models, loss_types, weights, build):
    hf_policy, trainer, policy, reference, root = models
    trainer.loss_types, trainer.loss_weights, trainer.beta = loss_types, weights, 0.3
    loss_type = "_".join(loss_types)
    hf_inputs, batch = _batch()
    theirs, seen = _trl_step(trainer, hf_policy, hf_inputs)
    policy.zero_grad()
    out = build()(_kiln_logps(policy, reference, batch))
    mine = out.losses.mean()
    mine.backward()

    torch.testing.assert_close(mine, theirs, **TOL)
    torch.testing.assert_close(out.chosen_rewards.mean().item(), seen["rewards/chosen"][0],
                               **TOL)
    torch.testing.assert_close(out.rejected_rewards.mean().item(),
                               seen["rewards/rejected"][0], **TOL)
    grads = hf_grads(policy, root / f"grads_{loss_type}")
    want = {n: p.grad for n, p in hf_policy.named_parameters()}
    assert set(grads) == set(want)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], **TOL, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_conservative_dpo_is_the_smoothed_sigmoid():
    """TRL 1.16's ``sigmoid`` has no label smoothing: conservative DPO against its definition
    (Mitchell 2023), and equal to TRL's at 0."""
    c, r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -3.0])
    p = PairLogps(c, r, torch.ones(2), torch.ones(2), rc, rr)
    h = 0.2 * ((c - rc) - (r - rr))
    eps = 0.1
    got = DPO(DPOConfig(type="dpo", beta=0.2, label_smoothing=eps))(p).losses
    want = -(1 - eps) * torch.nn.functional.logsigmoid(h) \
        - eps * torch.nn.functional.logsigmoid(-h)
    torch.testing.assert_close(got, want)


def _logps(seed):
    g = torch.Generator().manual_seed(seed)
    c = (-torch.rand(3, generator=g) * 2 - 0.1).requires_grad_()  # mean token log-probs
    r = (-torch.rand(3, generator=g) * 2 - 0.1).requires_grad_()
    return c, r, torch.tensor([3.0, 5.0, 2.0]), torch.tensor([4.0, 2.0, 6.0])


def _trl_self(**kw):
    return types.SimpleNamespace(accelerator=types.SimpleNamespace(device="cpu"), **kw)


def test_simpo_equals_trl_cpo_loss():
    from trl.experimental.cpo import CPOTrainer

    c, r, nc, nr = _logps(0)
    fake = _trl_self(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0,
                     label_smoothing=0.1)
    losses, chosen, rejected = CPOTrainer.cpo_loss(fake, c, r)
    theirs = torch.autograd.grad(losses.mean(), (c, r))
    p = PairLogps(c * nc, r * nr, nc, nr)  # sums over completion tokens
    out = SimPO(SimPOConfig(type="simpo", beta=2.0, gamma=0.7, label_smoothing=0.1))(p)
    mine = torch.autograd.grad(out.losses.mean(), (c, r))
    torch.testing.assert_close(out.losses, losses.detach(), **TOL)
    torch.testing.assert_close(out.chosen_rewards, chosen, **TOL)
    torch.testing.assert_close(out.rejected_rewards, rejected, **TOL)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_orpo_equals_trl_odds_ratio_loss():
    from trl.experimental.orpo import ORPOTrainer

    c, r, nc, nr = _logps(1)
    losses, chosen, rejected, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        _trl_self(beta=0.25), c, r)
    p = PairLogps(c * nc, r * nr, nc, nr)
    out = ORPO(ReferenceFreeConfig(type="orpo", beta=0.25))(p)
    nll = -(c * nc).sum() / nc.sum()
    # TRL: loss = nll - mean(beta * log sigmoid(log odds)); kiln's per-pair losses hold both
    torch.testing.assert_close(out.losses, nll - losses, **TOL)
    theirs = torch.autograd.grad((nll - losses).mean(), (c, r))
    mine = torch.autograd.grad(out.losses.mean(), (c, r))
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(out.chosen_rewards, chosen, **TOL)
    torch.testing.assert_close(out.rejected_rewards, rejected, **TOL)
    torch.testing.assert_close(out.extra["log_odds_ratio"], ratio.detach(), **TOL)
    torch.testing.assert_close(out.extra["log_odds_chosen"], log_odds.detach(), **TOL)


def _kto_batch():
    """(TRL's KTO inputs, kiln's batch): 4 examples (2 desirable), each with its mismatched
    row (its prompt, the next example's completion), kiln's rows examples then mismatched."""
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, 256, (4, PROMPT), generator=g)
    lengths = [6, 9, 4, 8]
    completions = [torch.randint(0, 256, (n,), generator=g) for n in lengths]

    def rows(which):
        ids, mask = torch.full((4, WIDTH), 258), torch.zeros(4, WIDTH, dtype=torch.long)
        for r in range(4):
            c = completions[which(r)]
            ids[r, :PROMPT], ids[r, PROMPT:PROMPT + len(c)] = prompts[r], c
            mask[r, PROMPT:PROMPT + len(c)] = 1
        attention = (torch.arange(WIDTH) < PROMPT + mask.sum(1, keepdim=True)).long()
        return ids, mask, attention

    (ids, mask, att), (kl, kl_mask, kl_att) = rows(lambda r: r), rows(lambda r: (r + 1) % 4)
    label = torch.tensor([True, False, True, False])
    hf = {"input_ids": ids, "attention_mask": att, "completion_mask": mask,
          "KL_input_ids": kl, "KL_attention_mask": kl_att, "KL_completion_mask": kl_mask,
          "label": label}
    both, both_mask = torch.cat([ids, kl]), torch.cat([mask, kl_mask])
    labels = torch.where(both_mask[:, 1:].bool(), both[:, 1:], IGNORE_INDEX)
    return hf, {"input_ids": both[:, :-1], "labels": labels, "desirable": label}


def test_kto_loss_rewards_and_gradients_equal_trl_kto_trainer(models):
    from datasets import Dataset

    from kiln.components.steps.preference_losses import KTO, KTOConfig

    hf_policy, dpo_trainer, policy, reference, root = models
    rows = [{"prompt": "t1", "completion": "t2", "label": b} for b in (True, False)] * 2
    args = trl.KTOConfig(output_dir=str(root / "kto"), report_to="none", use_cpu=True,
                         bf16=False, beta=0.3, desirable_weight=1.2, undesirable_weight=0.8)
    trainer = trl.KTOTrainer(model=hf_policy, ref_model=dpo_trainer.ref_model, args=args,
                             train_dataset=Dataset.from_list(rows),
                             processing_class=dpo_trainer.processing_class)
    hf_inputs, batch = _kto_batch()
    theirs, seen = _trl_step(trainer, hf_policy, hf_inputs)
    policy.zero_grad()
    p = _kiln_logps(policy, reference, batch, n=4)
    p.desirable = batch["desirable"]
    out = KTO(KTOConfig(type="kto", beta=0.3, desirable_weight=1.2, undesirable_weight=0.8))(p)
    out.losses.mean().backward()
    torch.testing.assert_close(out.losses.mean(), theirs, **TOL)
    torch.testing.assert_close(out.extra["kl"].item(), seen["kl"][0], **TOL)
    torch.testing.assert_close(out.chosen_rewards.nansum().item() / 2,
                               seen["rewards/chosen"][0], **TOL)
    grads = hf_grads(policy, root / "grads_kto")
    for name, g in grads.items():
        torch.testing.assert_close(g, hf_policy.get_parameter(name).grad, **TOL, msg=name)
