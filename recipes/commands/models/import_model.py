"""`kiln import SOURCE --out recipe.toml`: the recipe that continues training a Hugging Face
model (a folder with config.json + safetensors, or hf://OWNER/NAME[@REVISION]): its
architecture as kiln components, its tokenizer, and ``checkpoint.init_from = SOURCE`` so the
weights load when training starts. Unsupported config fields are errors naming the field."""

from __future__ import annotations

from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("source", help="Hugging Face model folder or hf://OWNER/NAME[@REVISION]")
    parser.add_argument("--out", required=True, help="recipe file to write")
    parser.add_argument("--seq-len", type=int, default=0,
                        help="training.seq_len (default: min(2048, the model's context))")
    parser.add_argument("--force", action="store_true",
                        help="overwrite --out if it is an existing file")
    parser.add_argument("--ignore-field", action="append", default=[],
                        help="a config.json field kiln does not know but that does not change "
                        "the computation (repeatable)")


def run(args) -> int:
    from kiln.components.errors import RecipeError
    from kiln.recipes.loading.hf_recipe import import_recipe

    out = Path(args.out)
    if out.is_dir():  # os.replace onto it raised a bare IsADirectoryError
        raise RecipeError(f"--out {out}: is a folder; give the recipe file to write, e.g. "
                          f"{out / 'imported.toml'}")
    if out.exists() and not args.force:  # a recipe the user wrote is not replaced silently
        raise RecipeError(f"--out {out}: the file exists; give a new path, or pass --force to "
                          "overwrite it")
    summary = import_recipe(args.source, out, seq_len=args.seq_len,
                            ignore=tuple(args.ignore_field))
    p = summary["params"]
    heads = f"{p['attention.n_heads']} heads"
    if "attention.n_kv_heads" in p:
        heads += f" / {p['attention.n_kv_heads']} kv heads"
    if p.get("attention.type") == "latent":
        heads += f" (latent attention, kv_rank {p['attention.kv_rank']})"
    linear = list(p.get("layer_types") or []).count("linear")
    if linear:
        heads += f" ({linear} linear-attention layers: {p['linear_attention.type']})"
    if p.get("ffn.type") == "moe":
        heads += f", {p['ffn.n_experts']} experts top {p['ffn.top_k']}"
    print(f"wrote {args.out}: {summary['family']} with dim {p['dim']}, {p['n_layers']} layers, "
          f"{heads}, vocabulary {p['vocab_size']}, seq_len {summary['seq_len']}, tokenizer "
          f"{summary['tokenizer']}")
    if summary["note"]:
        print(f"note: {summary['note']}")
    print(f"train it: ./run_train.sh {args.out}")
    return 0
