"""Save a small random Hugging Face model with ``transformers`` (no download), sharded with an
index: a stand-in for a pretrained checkpoint when trying ``kiln import`` offline.

    python scripts/tiny_hf_model.py OUT_DIR [--family llama|mistral|qwen2|qwen3|qwen3_next|
                                            deepseek_v3] [--rope llama3] [--no-tokenizer]

Needs ``transformers`` (in the ``dev`` extra). Like a real checkpoint the folder holds a
tokenizer: a byte-level BPE ``tokenizer.json`` (512 ids; BOS ``<|bos|>`` = 0, EOS ``<|eos|>`` =
1) trained here on this machine's Python standard library, which ``kiln import`` puts into the
recipe. With ``--no-tokenizer`` there is none (the import then uses kiln's byte tokenizer, whose
258 ids the 512-row vocabulary covers).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
            "qwen3_next": "Qwen3Next", "deepseek_v3": "DeepseekV3"}
# What the hybrid and MoE families add: Qwen3-Next's Gated DeltaNet layers (three to one full
# layer), partial RoPE and experts with a gated shared one; DeepSeek-V3's latent attention and
# grouped experts after a dense layer.
EXTRA = {
    "qwen3_next": dict(head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64),
    "deepseek_v3": dict(num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=48,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1),
}
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "rope_theta": 500000.0},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--family", default="llama", choices=list(FAMILIES))
    parser.add_argument("--rope", default="llama3", choices=list(ROPE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="no tokenizer.json (kiln import then picks the byte tokenizer)")
    args = parser.parse_args()
    import transformers

    specials = {"bos_token_id": 256, "eos_token_id": 257}
    if not args.no_tokenizer:
        specials = save_tokenizer(Path(args.out_dir))
    name = FAMILIES[args.family]
    rope = dict(ROPE[args.rope])
    if args.family == "qwen3_next":
        rope["partial_rotary_factor"] = 0.25
    sizes = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 384,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
             "max_position_embeddings": 2048, **EXTRA.get(args.family, {})}
    config = getattr(transformers, f"{name}Config")(
        **sizes, rope_parameters=rope, tie_word_embeddings=False, **specials)
    torch.manual_seed(args.seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    model.save_pretrained(args.out_dir, max_shard_size="500KB")
    print(f"saved a random {name} ({sum(p.numel() for p in model.parameters()):,} parameters) "
          f"to {args.out_dir}")


def save_tokenizer(out_dir: Path, vocab_size: int = 512) -> dict[str, int]:
    """Train a small BPE on 30 stdlib modules (deterministic) and save it into the new folder
    ``out_dir``; returns the config.json ids of its BOS and EOS."""
    from kiln.components.tokenizers.bpe_train import BOS, EOS, build_bpe, save_bpe

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:30]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok = build_bpe(texts, vocab_size)
    save_bpe(tok, out_dir)
    return {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}


if __name__ == "__main__":
    main()
