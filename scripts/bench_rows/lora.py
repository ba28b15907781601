"""A LoRA training step: kiln's ``lora`` adapter on its Llama debug model against ``peft``'s
``LoraConfig`` on ``transformers``' ``LlamaForCausalLM`` loaded from that model's ``kiln
export``: the same weights, rank 8, alpha 16, no dropout, on q/k/v/o of every layer; AdamW over
the adapters only, fp32, a batch of 4 x 256 random token ids, the same cross-entropy on both
sides (forward, backward, optimizer step, zero_grad). Tokens per second; model loading and two
warm-up steps are outside the timing. ``setup`` is the generation row's (one training step of
``train_configs/llama_debug.toml`` and its export).

The memory side (``lora_memory``) reports the optimizer state of the same LoRA step against full
fine-tuning of the same model with the same AdamW: what the adapters save.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench_rows.common import Unavailable, median_seconds, set_threads, trainers_adamw
from bench_rows.generate import setup  # noqa: F401  (the same checkpoint and export)

RANK, ALPHA = 8, 16.0


def _batch():
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 258, (4, 257), generator=g)
    return ids[:, :-1], ids[:, 1:]


def kiln_model(work: Path, lora: bool = True):
    from kiln.checkpointing.resume import find_checkpoint
    from kiln.components.adapters.lora import LoRA, LoRAConfig
    from kiln.recipes.loading.checkpoint_model import load_model

    _, _, model = load_model(find_checkpoint(work / "run"))
    if lora:
        LoRA(LoRAConfig(type="lora", rank=RANK, alpha=ALPHA)).apply(model)
    return model.train()


def timed_steps(forward, params, p: dict) -> tuple[float, object]:
    """Median seconds of one training step, and the optimizer after it."""
    import torch.nn.functional as F

    opt = trainers_adamw(params, 1e-4)
    ids, labels = _batch()

    def step() -> None:
        logits = forward(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(p["warmup"]):
        step()
    return median_seconds(step, p["steps"]), opt


def kiln(p: dict) -> dict:
    set_threads(p["threads"])
    model = kiln_model(Path(p["work"]))
    seconds, _ = timed_steps(model, [q for q in model.parameters() if q.requires_grad], p)
    return {"tokens_per_second": 4 * 256 / seconds, "step_s": seconds}


def peer(p: dict) -> dict:
    import torch

    try:
        import peft
        import transformers
    except ImportError as exc:
        raise Unavailable(f"peft and transformers are not importable in {sys.executable} "
                          f"({exc})") from None
    set_threads(p["threads"])
    base = transformers.AutoModelForCausalLM.from_pretrained(Path(p["work"]) / "export",
                                                             dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).train()
    seconds, _ = timed_steps(lambda ids: model(input_ids=ids).logits,
                             [q for q in model.parameters() if q.requires_grad], p)
    return {"tokens_per_second": 4 * 256 / seconds, "step_s": seconds,
            "version": f"peft {peft.__version__}, transformers {transformers.__version__}"}
