"""GRPO: sampled rollouts and one whole step (rollout + update), kiln against TRL's
``GRPOTrainer`` with ``transformers``' ``generate`` (no vLLM), on the generation row's Llama
debug checkpoint and its ``kiln export``: the same weights, fp32.

- ``rollout``: ``prompts`` prompts of ``prompt`` random token ids, ``group`` completions each,
  ``new_tokens`` new tokens per completion at temperature 1 (EOS never ends a row on either
  side: kiln passes no EOS, TRL sets ``min_new_tokens``), all rows in one batch. kiln's side is
  its ``kiln`` rollout component (one seeded generator per completion, the per-token
  log-probabilities and entropies reported); TRL's is ``transformers`` ``generate`` with the
  sampling settings ``GRPOTrainer`` passes it. Completion tokens per second.
- ``step``: kiln's rollout, a reward, group advantages, the training forward (chunked
  log-probabilities), the loss, backward and an AdamW step, against ``GRPOTrainer.training_step``
  (its generation, reward, advantages, forward, loss and backward) plus the same AdamW step.
  Seconds per step; model loading and a warm-up step are outside the timing.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench_rows.common import (
    Unavailable,
    median_seconds,
    set_threads,
    trainers_adamw,
    word_tokenizer,
)
from bench_rows.generate import setup  # noqa: F401  (the same checkpoint and export)


def _prompts(p: dict) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)  # ids 3..256: the byte tokenizer's bytes
    return torch.randint(3, 257, (p["prompts"], p["prompt"]), generator=g).tolist()


def _kiln_model(p: dict):
    from kiln.checkpointing.resume import find_checkpoint
    from kiln.recipes.loading.checkpoint_model import load_model

    _, _, model = load_model(find_checkpoint(Path(p["work"]) / "run"),
                             min_seq_len=p["prompt"] + p["new_tokens"] + 1)
    return model


def kiln(p: dict) -> dict:
    import torch

    from kiln.components.attention import shared_prefix
    from kiln.components.base import default_config
    from kiln.components.models.lm_head import IGNORE_INDEX
    from kiln.components.models.token_logprobs import LogprobHead
    from kiln.components.steps import grpo_batch, grpo_loss

    set_threads(p["threads"])
    model = _kiln_model(p)
    rollout = default_config("rollout", "kiln", temperature=1.0,
                             max_new_tokens=p["new_tokens"]).build()
    prompts = [q for q in _prompts(p) for _ in range(p["group"])]
    opt = trainers_adamw(model.parameters(), 1e-6)
    calls = iter(range(10 ** 6))
    share = p.get("share_prompts", True) and shared_prefix.problem(model.train()) is None

    def sample():
        seeds = [next(calls) for _ in prompts]
        return rollout(model, prompts, seeds, decode=lambda ids: "", stops=[], eos_id=None,
                       pad_id=0, vocab_size=258, lockstep=False)

    def step() -> None:
        samples = sample()
        rewards = torch.tensor([float(s.ids[0] % 2) for s in samples])  # any reward
        adv, _ = grpo_loss.group_advantages(rewards, p["group"], "group")
        rows = grpo_batch.training_rows(prompts, samples, 0, "cpu")
        model.train()
        labels, ids = rows.batch["labels"], rows.batch["input_ids"]
        head = LogprobHead(labels, 4096, 1.0, 258)
        # as the trainer's (share_prompts): each group's prompt computed once
        layout = shared_prefix.plan(ids, torch.arange(len(prompts)).view(-1, p["group"])) \
            if share else None
        logp = model(ids, head=head) if layout is None else layout.run(model, ids, head=head)
        terms = grpo_loss.token_terms(logp, logp.detach(), adv, epsilon=0.2, epsilon_high=0.2)
        grpo_loss.aggregate(terms.loss, labels != IGNORE_INDEX, "sequence",
                            completions=float(len(samples)), tokens=1.0,
                            max_new_tokens=p["new_tokens"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _measure(p, sample, step)


def _measure(p: dict, sample, step) -> dict:
    sample()  # warm-up
    completion_tokens = p["prompts"] * p["group"] * p["new_tokens"]
    if p["what"] == "rollout":
        seconds = median_seconds(sample, p["repeats"])
        return {"tokens_per_second": completion_tokens / seconds, "seconds": seconds}
    step()
    seconds = median_seconds(step, p["repeats"])
    return {"steps_per_second": 1 / seconds, "step_s": seconds}


def peer(p: dict) -> dict:
    import torch

    try:
        import transformers
        import trl
        from datasets import Dataset
    except ImportError as exc:
        raise Unavailable(f"trl and transformers are not importable in {sys.executable} "
                          f"({exc})") from None
    set_threads(p["threads"])
    policy = transformers.AutoModelForCausalLM.from_pretrained(
        Path(p["work"]) / "export", dtype=torch.float32)
    tokenizer = word_tokenizer()
    n = p["prompts"] * p["group"]
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, bf16=False,
        num_generations=p["group"], per_device_train_batch_size=n, temperature=1.0,
        max_completion_length=p["new_tokens"], learning_rate=1e-6,
        generation_kwargs={"min_new_tokens": p["new_tokens"]})
    texts = [" ".join(f"t{i}" for i in q) for q in _prompts(p)]
    trainer = trl.GRPOTrainer(
        model=policy, args=args, processing_class=tokenizer,
        reward_funcs=lambda completions, **kw: [float(len(c) % 2) for c in completions],
        train_dataset=Dataset.from_list([{"prompt": t} for t in texts]))
    trainer.current_gradient_accumulation_steps = 1  # (set by Trainer.train's loop)
    inputs = [{"prompt": t} for t in texts for _ in range(p["group"])]
    opt = trainers_adamw(policy.parameters(), 1e-6)

    def sample():
        ids = tokenizer(texts, return_tensors="pt")["input_ids"].repeat_interleave(p["group"], 0)
        config = transformers.GenerationConfig(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=p["new_tokens"],
            min_new_tokens=p["new_tokens"], pad_token_id=0, eos_token_id=257)
        with torch.no_grad():
            return policy.generate(ids, attention_mask=torch.ones_like(ids),
                                   generation_config=config)

    def step() -> None:
        policy.train()
        trainer.training_step(policy, inputs, None)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = _measure(p, sample, step)
    return {**out, "version": f"trl {trl.__version__}, transformers {transformers.__version__}"}
