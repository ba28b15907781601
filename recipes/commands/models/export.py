"""`kiln export CHECKPOINT OUT_DIR`: safetensors (sharded with an index above --max-shard-size)
+ config.json + generation_config.json + tokenizer files + recipe.toml.

For the dense transformer with standard attention the weights and config.json follow Hugging
Face's Llama layout, or Qwen2's / Qwen3's for q/k/v-only biases / QK-norm (``transformers``'
``AutoModelForCausalLM.from_pretrained(OUT_DIR)``); other models keep kiln's parameter names.
See ``checkpointing/huggingface/layout.py`` for the mapping."""

from __future__ import annotations

from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (e.g. runs/NAME/checkpoints/final)")
    parser.add_argument("out_dir", help="folder to write (new or empty; see --force)")
    parser.add_argument("--force", action="store_true",
                        help="export into a non-empty folder: overwrite the export's files "
                        "there (weights, configs, tokenizer files, recipe.toml), leave the rest")
    parser.add_argument("--format", choices=("auto", "hf", "kiln", "peft"), default="auto",
                        help="auto: Hugging Face layout when the model has one, else kiln; "
                        "a LoRA run's adapters are merged into the weights, or written alone "
                        "as a peft adapter folder with peft")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file (e.g. 5GB, 500MB); more files get an index")
    parser.add_argument("--dtype", default="", choices=("", "float32", "bfloat16", "float16"),
                        help="cast the weights (default: as trained)")


def run(args) -> int:
    from kiln.checkpointing.resume import find_checkpoint
    from kiln.recipes.inference.saved_model import export_checkpoint

    folder = find_checkpoint(Path(args.checkpoint))
    summary = export_checkpoint(folder, Path(args.out_dir), args.format, force=args.force,
                                max_shard_size=args.max_shard_size, dtype=args.dtype)
    layout = {"hf": f"Hugging Face {summary['family']}", "peft": "peft LoRA adapter"}.get(
        summary["layout"], "kiln")
    print(f"exported {folder} -> {args.out_dir} ({layout} layout, {summary['tensors']} "
          f"tensors): {', '.join(summary['files'])}")
    if summary.get("base_note"):
        print(f"note: {summary['base_note']}")
    if summary["layout"] == "kiln" and summary["why_not_hf"]:
        print(f"(no Hugging Face layout: {summary['why_not_hf']})")
    return 0
