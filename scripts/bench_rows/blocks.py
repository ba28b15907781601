"""Model blocks of 2026's baselines against ``transformers``' on the same configuration: a
4-layer model (width 256, 4 heads of 64, 2 kv heads, vocabulary 512) of each style, one
training step in the same plain loop (forward, cross-entropy, backward, AdamW, zero_grad) on
random batches of 4 x 256, fp32. Tokens per second.

- ``gpt_oss``: gpt-oss's attention (q/k/v/o biases, learned sinks, a 64-token window on every
  other layer) over 8 experts, top 2, softmax gates. kiln: ``causal`` attention with
  ``sinks``, ``window``, ``layer_types`` and the ``moe`` feed-forward with gpt-oss's experts
  (``experts = "gpt_oss"``, a router bias, no balancing bias); transformers: ``GptOssForCausalLM``
  (eager attention, which its sinks need).
- ``qwen3_next``: Qwen3-Next's hybrid, three Gated DeltaNet layers (4 value heads, 2 key heads
  of 64) to one gated full-attention layer with QK-norm, dense SwiGLU feed-forwards of 512.
  kiln: ``model.layer_types`` with ``gated_deltanet``; transformers: ``Qwen3NextForCausalLM``
  with ``mlp_only_layers`` on every layer (its Gated DeltaNet falls back to PyTorch without the
  flash-linear-attention kernels, as on any CPU).
"""

from __future__ import annotations

from bench_rows.common import REPO, set_threads, timed_train_steps

BATCH, SEQ, VOCAB = 4, 256, 512
COMMON = ["--model.dim=256", "--model.n_layers=4", "--model.attention.n_heads=4",
          "--model.attention.n_kv_heads=2", "--model.vocab_size=512",
          "--model.tie_embeddings=false", f"--training.seq_len={SEQ}"]
KILN = {
    "gpt_oss": ["--model.attention.bias=true", "--model.attention.sinks=true",
                "--model.attention.window=64",
                '--model.layer_types=["sliding","full","sliding","full"]',
                "--model.ffn.type=moe", "--model.ffn.n_experts=8", "--model.ffn.top_k=2",
                "--model.ffn.hidden_dim=256", "--model.ffn.bias_update_coeff=0",
                "--model.ffn.experts=gpt_oss", "--model.ffn.router_bias=true"],
    "qwen3_next": ['--model.layer_types=["linear","linear","linear","full"]',
                   "--model.linear_attention.type=gated_deltanet",
                   "--model.linear_attention.n_heads=4", "--model.linear_attention.n_key_heads=2",
                   "--model.linear_attention.head_dim=64", "--model.attention.qk_norm=true",
                   "--model.attention.output_gate=true", "--model.ffn.hidden_dim=512"],
}


def _transformers_model(what: str):
    import torch
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=2 * SEQ,
                tie_word_embeddings=False)
    if what == "gpt_oss":
        config = transformers.GptOssConfig(
            **base, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls, attention = transformers.GptOssForCausalLM, "eager"
    else:
        config = transformers.Qwen3NextConfig(
            **base, intermediate_size=512, linear_conv_kernel_dim=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            mlp_only_layers=[0, 1, 2, 3])
        cls, attention = transformers.Qwen3NextForCausalLM, "sdpa"
    config._attn_implementation = attention
    torch.manual_seed(0)
    return cls(config).float().train()


def kiln(p: dict) -> dict:
    import torch

    from kiln.recipes.config.files import load_recipe

    set_threads(p["threads"])
    recipe = load_recipe(str(REPO / "train_configs" / "debug.toml"), [*COMMON, *KILN[p["what"]]])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=VOCAB, seq_len=SEQ).train()
    seconds = timed_train_steps(model, list(model.parameters()), p, (BATCH, SEQ, VOCAB))
    return {"tokens_per_second": BATCH * SEQ / seconds,
            "params": sum(x.numel() for x in model.parameters())}


def peer(p: dict) -> dict:
    set_threads(p["threads"])
    model = _transformers_model(p["what"])
    seconds = timed_train_steps(lambda ids: model(ids).logits, list(model.parameters()), p,
                                (BATCH, SEQ, VOCAB))
    return {"tokens_per_second": BATCH * SEQ / seconds,
            "params": sum(x.numel() for x in model.parameters())}
