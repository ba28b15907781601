"""``kiln export``: a model as safetensors (sharded above a size, with an index) + config.json +
generation_config.json + the tokenizer's files + recipe.toml.

Two layouts:

- ``hf``: for the dense ``transformer`` with causal attention, RoPE (any scaling), SwiGLU and
  RMSNorm, Hugging Face's Llama layout, or Qwen2's (q/k/v-only biases) or Qwen3's (QK-norm):
  loadable with ``transformers``' ``from_pretrained``. The mapping is in ``hf_layout``.
- ``kiln``: the model's own parameter names (torchtitan's), ``config.json`` holding the model
  table of the recipe. Works for every registered model.

``auto`` picks ``hf`` when the model has that layout. The model may be sharded (FSDP2
DTensors): every rank calls ``export``, each writes its share of the files into a temporary
folder, and rank 0 publishes the folder with one rename once all are written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from kiln.checkpointing.huggingface import config as hf_config
from kiln.checkpointing.huggingface import files as hf_files
from kiln.checkpointing.huggingface import layout as hf_layout
from kiln.components import distributed
from kiln.components.adapter_contract import adapter_layers
from kiln.components.errors import CheckpointError, RecipeError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export(model: torch.nn.Module, tokenizer, out_dir: str | Path, *, model_table: dict,
           recipe_file: Path | None, fmt: str = "auto", force: bool = False,
           max_shard_size: str | int = "5GB", dtype: str = "",
           tokenizer_files: Callable[[Path], Any] | None = None,
           rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Write ``model`` to ``out_dir``; returns a summary (layout, files, tensors).

    ``model_table`` is the recipe's resolved ``[model]`` table (the kiln layout's config.json);
    ``recipe_file`` is copied beside the weights; ``tokenizer_files(folder)`` writes the
    tokenizer's own files (e.g. tokenizer.json). Rebuilding a model from a checkpoint is the
    caller's job (``kiln.recipes.inference.saved_model``).

    A non-empty ``out_dir`` is refused unless ``force``; then only the files the export writes
    are replaced in it (and weight shards or an index an earlier export left there, which would
    otherwise mix with the new weights), nothing else there is touched. The files are written
    into a fresh temporary folder beside ``out_dir`` first (moved into place at the end, removed
    on error): export never deletes anything it did not create."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RecipeError(f"{out_dir}: exists and is not a folder; give a folder to export into")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise RecipeError(
            f"{out_dir}: folder exists and is not empty; export into a new or empty folder, or "
            "pass --force to overwrite only the export's files (weights, config.json, "
            "generation_config.json, tokenizer files, recipe.toml) in it")
    if adapter_layers(model):
        raise CheckpointError(
            "export: the model has adapters; `kiln export CHECKPOINT OUT_DIR` merges them "
            "into the weights (or --format peft writes them alone)")
    reason = hf_layout.hf_incompatibility(model)
    if fmt == "hf" and reason:
        raise CheckpointError(f"--format hf: this model has no Hugging Face layout: {reason}; "
                              "use --format kiln")
    use_hf = fmt == "hf" or (fmt == "auto" and not reason)
    if dtype and dtype not in DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    cast = DTYPES.get(dtype)
    family = hf_config.family_of(model) if use_hf else "kiln"
    named = hf_layout.tensors(model)
    layout = hf_layout.parts(model) if use_hf else hf_layout.identity_parts(model)
    if use_hf:  # transformers has no place for multi-token prediction modules: dropped
        dropped = [k for k in named if hf_layout.kept_at_init(k, layout)]
        _check_no_balancing_bias(named, dropped, family)
        named = {k: v for k, v in named.items() if k not in dropped}
    missing = sorted(set(named) - set(layout))
    if missing:
        raise CheckpointError(f"export: no Hugging Face tensor for {', '.join(missing)}")
    tmp = None
    if rank == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # Not tempfile.mkdtemp: its folders are 0700, and this one becomes the export.
        folder = out_dir.parent / f".{out_dir.name}.{secrets.token_hex(6)}.kiln-export"
        folder.mkdir()  # mode from the umask; exclusive, so never another call's folder
        tmp = str(folder)
    tmp = Path(distributed.broadcast_object(tmp))
    try:
        index = hf_files.write_sharded(
            ((named[k], layout[k]) for k in named), tmp, max_bytes=hf_files.parse_size(
                max_shard_size), rank=rank, world_size=world_size, dtype=cast)
        if rank == 0:
            _write_metadata(tmp, model, tokenizer, family, use_hf, dtype if cast else "",
                            model_table, index, recipe_file, tokenizer_files)
        distributed.barrier()  # every rank's files are in tmp
        if rank == 0:
            files = sorted(p.name for p in tmp.iterdir())
            _publish(tmp, out_dir)
    except OSError as exc:
        raise CheckpointError(f"{out_dir}: cannot write the export ({exc})") from exc
    finally:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # the temporary folder this call created, and only it
    files = distributed.broadcast_object(files if rank == 0 else None)
    return {"layout": "hf" if use_hf else "kiln", "family": family,
            "tensors": len(index["weight_map"]), "why_not_hf": reason, "files": files}


def _check_no_balancing_bias(named: dict, dropped: list[str], family: str) -> None:
    """A family without aux-loss-free balancing (gpt-oss, Qwen3-Next) has no place for the
    expert bias: exporting a moved one would change which experts the model picks."""
    for name in dropped:
        if name.endswith("expert_bias"):
            t = named[name]
            t = t.full_tensor() if isinstance(t, DTensor) else t
            if bool(t.detach().abs().max() > 0):
                raise CheckpointError(
                    f"export: {name} is not zero (aux-loss-free balancing moved it) and "
                    f"{family} routes without it, so transformers would pick other experts; "
                    "train with model.ffn.bias_update_coeff = 0, or export --format kiln")


def _write_metadata(tmp: Path, model, tokenizer, family: str, use_hf: bool, dtype: str,
                    model_table: dict, index: dict, recipe_file: Path | None,
                    tokenizer_files: Callable[[Path], Any] | None) -> None:
    if use_hf:
        config = hf_config.hf_config(model, tokenizer, family)
        if dtype:
            config["dtype"] = dtype
        _write_json(tmp / "generation_config.json", hf_config.generation_config(tokenizer))
    else:
        config = {"format": "kiln", "model": model_table,
                  "vocab_size": getattr(model, "vocab_size", None),
                  "num_params": int(model.num_params()) if hasattr(model, "num_params") else None}
    _write_json(tmp / "config.json", config)
    if len(set(index["weight_map"].values())) > 1:
        _write_json(tmp / hf_files.INDEX, index)
    if recipe_file is not None:
        shutil.copyfile(recipe_file, tmp / "recipe.toml")
    if tokenizer_files is not None:
        tokenizer_files(tmp)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished export into place: take the folder's place when it is absent or
    empty, else (``--force``) replace the export's own files in it one by one."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    for stale in hf_files.weight_files(out_dir):  # an earlier export's shards / index
        stale.unlink()
    for path in tmp.iterdir():
        os.replace(path, out_dir / path.name)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
