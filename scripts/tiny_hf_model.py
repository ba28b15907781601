"""Save a small random Hugging Face model with ``transformers`` (no download), sharded with an
index: a stand-in for a pretrained checkpoint when trying ``kiln import`` offline.

    python scripts/tiny_hf_model.py OUT_DIR [--family llama|mistral|qwen2|qwen3] [--rope llama3]

Needs ``transformers`` (in the ``dev`` extra). The vocabulary (512) covers the byte tokenizer's
258 ids, so the imported recipe trains on kiln's default data.
"""

from __future__ import annotations

import argparse

import torch

FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
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
    args = parser.parse_args()
    import transformers

    name = FAMILIES[args.family]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        rope_parameters=dict(ROPE[args.rope]), bos_token_id=256, eos_token_id=257,
        tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    model.save_pretrained(args.out_dir, max_shard_size="500KB")
    print(f"saved a random {name} ({sum(p.numel() for p in model.parameters()):,} parameters) "
          f"to {args.out_dir}")


if __name__ == "__main__":
    main()
