"""A DPO training step: kiln's ``preference`` step loss (``dpo``, beta 0.1) on its Llama debug
model against TRL's ``DPOTrainer`` on ``transformers``' ``LlamaForCausalLM`` loaded from that
model's ``kiln export``: the same weights, a frozen copy of them as the reference on both sides,
fp32, a batch of 4 pairs x 256 tokens (chosen rows then rejected rows, a shared 64-token prompt,
the loss on the rest). One step is the policy's and the reference's forward, the loss, backward
and an AdamW step over every weight. Pairs per second; model loading and warm-up steps are
outside the timing. ``setup`` is the generation row's checkpoint and export.

The memory side (``dpo_memory``) reports the peak resident memory of one DPO step of the same
model with LoRA adapters (rank 8, q/k/v/o) when the reference is the policy with its adapters
switched off against a frozen copy of the base.
"""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

from bench_rows.common import (
    Unavailable,
    median_seconds,
    set_threads,
    trainers_adamw,
    word_tokenizer,
)
from bench_rows.generate import setup  # noqa: F401  (the same checkpoint and export)

PAIRS, WIDTH, PROMPT = 4, 257, 64


def batch():
    """(rows (2 * PAIRS, WIDTH) token ids, the completion mask): chosen rows, then rejected."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 258, (2 * PAIRS, WIDTH), generator=g)
    rows[PAIRS:, :PROMPT] = rows[:PAIRS, :PROMPT]  # each pair shares its prompt
    mask = torch.zeros_like(rows)
    mask[:, PROMPT:] = 1
    return rows, mask


def kiln_step(policy, p: dict, *, reference: str = "frozen_copy"):
    """A closure running one DPO step of ``policy`` (kiln's step loss and its reference)."""
    import copy

    import torch

    from kiln.components.attention import shared_prefix
    from kiln.components.models.lm_head import IGNORE_INDEX
    from kiln.components.models.token_logprobs import LogprobHead
    from kiln.components.steps.preference import PreferenceStep, PreferenceStepConfig

    rows, mask = batch()
    kiln_batch = {"input_ids": rows[:, :-1],
                  "labels": torch.where(mask[:, 1:].bool(), rows[:, 1:], IGNORE_INDEX)}

    def logprobs(b, model=None, groups=None):
        """As the trainer's: each pair's prompt computed once (share_prompts) where it can."""
        model, head = model or policy, LogprobHead(b["labels"], 4096)
        ids = b["input_ids"]
        layout = None if groups is None or shared_prefix.problem(model) else \
            shared_prefix.plan(ids, groups)
        logp = model(ids, head=head) if layout is None else layout.run(model, ids, head=head)
        return logp, b["labels"] != IGNORE_INDEX

    ctx = types.SimpleNamespace(model=policy, token_logprobs=logprobs)
    step = PreferenceStep(PreferenceStepConfig(type="preference", reference=reference,
                                               share_prompts=p.get("share_prompts", True)))
    build = types.SimpleNamespace(lines=[], without_adapters=lambda: None,
                                  shared_prefix_problem=lambda: shared_prefix.problem(policy))
    if reference == "adapters_off":
        from kiln.components.adapters.lora import LoRA, LoRAConfig

        lora = LoRA(LoRAConfig(type="lora", rank=8, alpha=16.0))
        build.without_adapters = lambda: lora.disabled(policy)
    build.frozen_model = lambda source: copy.deepcopy(policy).eval().requires_grad_(False)
    step.setup(build)
    opt = trainers_adamw([q for q in policy.parameters() if q.requires_grad], 1e-5)

    def run() -> None:
        out, _ = step.pair_loss(ctx, kiln_batch)
        out.losses.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def kiln(p: dict) -> dict:
    from bench_rows.lora import kiln_model

    set_threads(p["threads"])
    run = kiln_step(kiln_model(Path(p["work"]), lora=False), p)
    for _ in range(p["warmup"]):
        run()
    seconds = median_seconds(run, p["steps"])
    return {"pairs_per_second": PAIRS / seconds, "step_s": seconds}


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
    load = transformers.AutoModelForCausalLM.from_pretrained
    export = Path(p["work"]) / "export"
    policy, ref = (load(export, dtype=torch.float32) for _ in range(2))
    tokenizer = word_tokenizer()
    args = trl.DPOConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True,
                         bf16=False, beta=0.1, learning_rate=1e-5)
    pairs = Dataset.from_list([{"prompt": "t1", "chosen": "t2", "rejected": "t3"}] * 2)
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=pairs,
                             processing_class=tokenizer)
    rows, mask = batch()
    inputs = {"input_ids": rows, "attention_mask": torch.ones_like(rows),
              "completion_mask": mask}
    opt = trainers_adamw(policy.parameters(), 1e-5)
    policy.train()

    def run() -> None:
        trainer._compute_loss(policy, inputs, False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(p["warmup"]):
        run()
    seconds = median_seconds(run, p["steps"])
    return {"pairs_per_second": PAIRS / seconds, "step_s": seconds,
            "version": f"trl {trl.__version__}, transformers {transformers.__version__}"}
