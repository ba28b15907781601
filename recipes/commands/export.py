"""`kiln export CHECKPOINT OUT_DIR`: consolidated safetensors + config.json + recipe.toml.

For the dense transformer with standard attention the weights and config.json follow Hugging
Face's Llama layout (``transformers``' ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``); other
models keep kiln's parameter names. See ``checkpointing/export.py`` for the mapping."""

from __future__ import annotations

from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (e.g. runs/NAME/checkpoints/final)")
    parser.add_argument("out_dir", help="folder to write (new or empty; see --force)")
    parser.add_argument("--force", action="store_true",
                        help="export into a non-empty folder: overwrite config.json, "
                        "model.safetensors and recipe.toml there, leave everything else")
    parser.add_argument("--format", choices=("auto", "hf", "kiln"), default="auto",
                        help="auto: Hugging Face Llama layout when the model has one, else kiln")


def run(args) -> int:
    from kiln.checkpointing.resume import find_checkpoint
    from kiln.recipes.saved_model import export_checkpoint

    folder = find_checkpoint(Path(args.checkpoint))
    summary = export_checkpoint(folder, Path(args.out_dir), args.format, force=args.force)
    print(f"exported {folder} -> {args.out_dir} ({summary['layout']} layout, "
          f"{summary['tensors']} tensors): {', '.join(summary['files'])}")
    if summary["layout"] == "kiln" and summary["why_not_hf"]:
        print(f"(no Hugging Face layout: {summary['why_not_hf']})")
    return 0
