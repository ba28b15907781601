"""The rows of ``scripts/bench_peers.py``: each ``Group`` is one ``bench_rows`` module's kiln and
peer sides with their parameters, and the ``Row`` lines of the table it fills."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    """One line of the table, read from a group's side results."""

    label: str
    metric: str
    unit: str
    higher_is_better: bool = True
    goal: str = ""  # the kiln speed-up aimed for, as printed


@dataclass
class Group:
    """One measurement: a ``bench_rows`` module's ``kiln`` and ``peer`` sides with parameters."""

    name: str
    module: str
    peer: str  # what the peer is, for the table
    rows: list[Row]
    params: dict = field(default_factory=dict)
    third_party: bool = True  # the peer runs in --peer-python
    paired: bool = False  # the module times both sides itself (``both``)


def groups(args) -> list[Group]:
    quick = args.quick
    steps, warmup = (2, 1) if quick else (args.steps, args.warmup)
    base = {"threads": args.threads, "work": str(args.work)}
    out = []
    for compiled in (False, True):
        for bf16 in (False, True):
            kind = f"{'bf16' if bf16 else 'fp32'}{' compiled' if compiled else ' eager'}"
            name = f"train-{'bf16' if bf16 else 'fp32'}{'-compile' if compiled else ''}"
            rows = [Row(f"dense training step, {kind}", "tokens_per_second", "tok/s",
                        goal=">= 1.3x")]
            if name == "train-fp32":
                rows.append(Row("time to first step, fp32 eager", "time_to_first_step_s", "s",
                                higher_is_better=False))
            out.append(Group(name, "train", "torchtitan llama3 debugmodel (model code)", rows,
                             {**base, "bf16": bf16, "compile": compiled, "steps": steps,
                              "warmup": warmup}))
    for bf16 in (False, True):
        dtype = "bf16" if bf16 else "fp32"
        out.append(Group(f"moe-{dtype}", "moe", "torchtitan MoE module",
                         [Row(f"MoE layer training step, {dtype}", "tokens_per_second", "tok/s",
                              goal=">= 1.3x")],
                         {**base, "bf16": bf16, "steps": steps, "warmup": warmup}))
    new_tokens = 8 if quick else args.new_tokens
    for batch in (1, 8):
        out.append(Group(f"generate-b{batch}", "generate", "transformers generate",
                         [Row(f"generation, batch {batch}, greedy, {new_tokens} new tokens",
                              "tokens_per_second", "tok/s", goal=">= 1.5x")],
                         {**base, "batch": batch, "prompt": 32, "new_tokens": new_tokens,
                          "repeats": 1 if quick else 3}))
    out.append(Group("eval", "eval", "lm-evaluation-harness hf model (loglikelihood)",
                     [Row("downstream multiple choice", "examples_per_second", "examples/s")],
                     {**base, "rounds": 1 if quick else args.rounds,
                      "examples": 8 if quick else 200}, third_party=False, paired=True))
    repeats = 1 if quick else 5
    out.append(Group("checkpoint", "checkpoint", "bare dcp.save / dcp.load",
                     [Row("checkpoint save", "save_mb_per_s", "MB/s", goal=">= 0.9x"),
                      Row("checkpoint load", "load_mb_per_s", "MB/s", goal=">= 0.9x")],
                     {**base, "repeats": repeats}, third_party=False))
    out.append(Group("overhead", "overhead", "plain PyTorch loop, same model",
                     [Row("step time, tiny model (host overhead)", "step_ms", "ms",
                          higher_is_better=False, goal=">= 0.95x")],
                     {**base, "steps": 5 if quick else 200, "warmup": 2 if quick else 20},
                     third_party=False))
    out.append(Group("mixture-loader", "mixture", "one packed_documents source (its code)",
                     [Row("data loader, one global step, 3-source mixture", "step_us", "µs",
                          higher_is_better=False, goal=">= 0.95x")],
                     {**base, "steps": 20 if quick else 2000, "warmup": 5 if quick else 200},
                     third_party=False))
    out.append(Group("sft-data", "sft_data", "transformers apply_chat_template + tokenizers",
                     [Row("SFT data: render, assistant mask, tokenize", "conversations_per_second",
                          "conv/s", goal=">= 1x")],
                     {**base, "conversations": 200 if quick else 2000,
                      "repeats": 1 if quick else 3}, third_party=False))
    out.append(Group("lora-step", "lora", "peft LoRA on transformers (same model)",
                     [Row("LoRA training step, rank 8 on q/k/v/o, fp32", "tokens_per_second",
                          "tok/s", goal=">= 1.3x")],
                     {**base, "steps": 2 if quick else 10, "warmup": 1 if quick else 2},
                     third_party=False))
    out.append(Group("lora-memory", "lora_memory", "full fine-tuning, same model and AdamW",
                     [Row("optimizer state, LoRA vs full fine-tuning", "optimizer_mb", "MiB",
                          higher_is_better=False, goal="report")],
                     {**base, "steps": 1, "warmup": 0}, third_party=False))
    out.append(Group("dpo-step", "dpo", "TRL DPOTrainer on transformers (same model)",
                     [Row("DPO training step, frozen reference copy, fp32", "pairs_per_second",
                          "pairs/s", goal=">= 1.3x")],
                     {**base, "steps": 2 if quick else 10, "warmup": 1 if quick else 2}))
    out.append(Group("dpo-memory", "dpo_memory", "a frozen copy of the base as the reference",
                     [Row("DPO step with LoRA, 60M parameters, peak memory: adapters-off reference",
                          "peak_mb", "MiB", higher_is_better=False, goal="report")],
                     {**base}, third_party=False))
    grpo = {**base, "prompts": 4, "group": 8, "prompt": 32,
            "new_tokens": 8 if quick else 64, "repeats": 1 if quick else 3}
    out.append(Group("grpo-rollout", "grpo", "transformers generate, TRL GRPO's sampling",
                     [Row(f"GRPO rollout, 4 prompts x 8, {grpo['new_tokens']} new tokens, "
                          "temperature 1", "tokens_per_second", "tok/s", goal=">= 1.5x")],
                     {**grpo, "what": "rollout"}))
    out.append(Group("grpo-rollout-long", "grpo", "transformers generate, TRL GRPO's sampling",
                     [Row(f"GRPO rollout, 4 prompts of 512 tokens x 8, {grpo['new_tokens']} new "
                          "tokens (the prompt's keys shared by its group)", "tokens_per_second",
                          "tok/s", goal="report")],
                     {**grpo, "prompt": 512, "what": "rollout"}))
    out.append(Group("grpo-step", "grpo", "TRL GRPOTrainer.training_step on transformers",
                     [Row("GRPO step (rollout + update), fp32", "steps_per_second", "steps/s",
                          goal=">= 1.3x")],
                     {**grpo, "what": "step"}))
    for what, peer, label in (
            ("gpt_oss", "transformers GptOssForCausalLM (eager attention)",
             "gpt-oss-style blocks (sinks, windows, 8 experts top 2)"),
            ("qwen3_next", "transformers Qwen3NextForCausalLM (PyTorch Gated DeltaNet)",
             "Qwen3-Next-style blocks (3 Gated DeltaNet : 1 gated attention)")):
        out.append(Group(f"blocks-{what.replace('_', '-')}", "blocks", peer,
                         [Row(f"{label}, training step, 4 x 256, fp32", "tokens_per_second",
                              "tok/s", goal=">= 1.3x")],
                         {**base, "what": what, "steps": 2 if quick else 10,
                          "warmup": 1 if quick else 2}, third_party=False))
    gpt2 = {**base, "threads": 1, "steps": 3 if quick else 100, "warmup": 1 if quick else 10}
    out.append(Group("gpt2-model", "gpt2", "transformers GPT2LMHeadModel (same weights, SDPA)",
                     [Row("GPT-2 training step, 4 x 128, block 64, batch 12, fp32, 1 thread",
                          "tokens_per_second", "tok/s", goal=">= 1.3x")],
                     {**gpt2, "what": "model"}, third_party=False))
    out.append(Group("gpt2-loop", "gpt2", "nanoGPT's training loop, same model",
                     [Row("GPT-2 recipe step vs a plain loop, nanoGPT CPU size, 1 thread",
                          "tokens_per_second", "tok/s", goal=">= 1.1x")],
                     {**gpt2, "what": "loop"}, third_party=False))
    for length in (1024, 4096):
        out.append(Group(f"window-{length}", "window", "the same layer, the whole masked row",
                         [Row(f"sliding-window attention, window 128, {length} tokens "
                              f"({length // 128} windows), forward + backward", "step_ms", "ms",
                              higher_is_better=False, goal="report")],
                         {**base, "length": 256 if quick else length,
                          "steps": 2 if quick else 10, "warmup": 1 if quick else 2},
                         third_party=False))
    out.append(Group("fit", "fit", "the same fit, one scipy L-BFGS refit per resample",
                     [Row("scaling-law fit, 20 points, 1,000 bootstrap refits", "seconds", "s",
                          higher_is_better=False, goal="< 10 s")],
                     {**base, "resamples": 100 if quick else 1000}, third_party=False))
    return out
