"""Hugging Face checkpoints as the initial weights of a kiln model (``checkpoint.init_from``).

``source_folder(spec)`` turns a folder or ``hf://OWNER/NAME[@REVISION]`` into a local folder
(config.json + one or many safetensors, an index when many). ``load_weights(model, folder)``
copies the tensors into a built model, converting the layout (``hf_layout``). A sharded model
(FSDP2 DTensor parameters, e.g. after meta-device init) receives only its own slices: each rank
reads the rows (and columns) it owns from the files, so the model never exists whole on a rank.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from kiln.checkpointing.huggingface import fp8, mxfp4
from kiln.checkpointing.huggingface import layout as hf_layout
from kiln.checkpointing.huggingface.families import deepseek, qwen3_next
from kiln.checkpointing.huggingface.files import SafetensorsFolder
from kiln.checkpointing.huggingface.parts import hf_shapes
from kiln.components import distributed
from kiln.components.errors import CheckpointError

# Stored by some older checkpoints, derived from the config: RoPE tables (kiln recomputes them)
# and GPT-2's causal masks.
DERIVED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def source_folder(spec: str, *, is_main: bool = True, api=None,
                  token_env: str = "HF_TOKEN") -> Path:
    """A local folder for ``spec`` (a folder, or hf://... fetched by the main rank first; the
    others then find it in the shared cache)."""
    if not spec.startswith("hf://"):
        folder = Path(spec).expanduser()
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{spec!r}: no config.json there; give a Hugging Face model "
                                  "folder or hf://OWNER/NAME[@REVISION]")
        return folder
    from kiln.checkpointing.huggingface import hub

    folder = hub.download_model(spec, api=api, token_env=token_env) if is_main else None
    distributed.barrier()
    return folder or hub.download_model(spec, api=api, token_env=token_env)


def content_fingerprint(folder: Path) -> str:
    """xxh3-128 of the weights a Hugging Face folder holds (every ``.safetensors`` file by name
    and content, and ``config.json``): what an adapters-only checkpoint's frozen base is,
    wherever the folder lives. Reads the weights once per process (``_fingerprint`` keeps it
    by the files' sizes and modification times)."""
    files = [p for p in sorted(Path(folder).glob("*.safetensors")) if p.is_file()]
    files += [p for p in [Path(folder) / "config.json"] if p.is_file()]
    stamp = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _fingerprint(stamp)


@functools.lru_cache(maxsize=16)
def _fingerprint(stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = xxhash.xxh3_128()
    for name, _, _ in stamp:
        h.update(Path(name).name.encode() + b"\0")
        with open(name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a Hugging Face model folder has a config.json"
                              ) from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor to fill, its global offset, its shape) of a parameter or DTensor shard."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
        return t.to_local(), tuple(offset), tuple(shape)
    return t, (0,) * t.dim(), tuple(t.shape)


@torch.no_grad()
def load_weights(model: nn.Module, folder: Path, config: dict, label: str = "", *,
                 check_only: bool = False) -> int:
    """Copy a Hugging Face checkpoint into ``model`` (built and allocated, possibly sharded);
    returns the number of tensors read. Every kiln tensor must come from the checkpoint and
    every checkpoint tensor must be used; shapes must agree. ``check_only``: those checks alone,
    from the files' headers (``model`` may be on the meta device: ``kiln validate``)."""
    label = label or str(folder)
    reason = hf_layout.hf_incompatibility(model)
    if reason:
        raise CheckpointError(f"{label}: the recipe's model has no Hugging Face layout "
                              f"({reason}); write the recipe with `kiln import`")
    layout = hf_layout.parts(model)
    # multi-token prediction modules (and the like) have no Hugging Face tensors: kept at init
    targets = {k: v for k, v in hf_layout.tensors(model).items()
               if not hf_layout.kept_at_init(k, layout)}
    unmapped = sorted(set(targets) - set(layout))
    if unmapped:
        raise CheckpointError(f"{label}: kiln tensors with no Hugging Face counterpart: "
                              f"{', '.join(unmapped)}")
    files = SafetensorsFolder(folder)
    files.fp8_block = fp8.block_size(config, label)  # DeepSeek-V3's FP8: dequantized on read
    if mxfp4.applies(config):  # gpt-oss's released experts: dequantized on read
        files.enable_mxfp4()
    needed = {p.hf_name for name in targets for p in layout[name]}
    if config.get("model_type") == "gpt2":  # OpenAI's checkpoints: no "transformer." prefix
        files.add_prefix("transformer.", keep=("lm_head.",))
    have = files.keys()
    absent = sorted(needed - have)
    if absent:
        raise CheckpointError(f"{label}: the checkpoint lacks {', '.join(absent[:5])}"
                              f"{' ...' if len(absent) > 5 else ''} ({len(absent)} tensors); "
                              "does the recipe's model match its config.json?")
    family = config.get("model_type")
    extra = sorted(n for n in have - needed if not n.endswith(DERIVED) and not (
        family == "deepseek_v3" and deepseek.unused(n, config))
        and not (family == "qwen3_next" and qwen3_next.unused(n))
        and not (files.fp8_block and n.endswith(fp8.SCALE)))
    if getattr(model, "tied", False) and extra == ["lm_head.weight"] and config.get(
            "tie_word_embeddings"):
        extra = []  # a tied checkpoint that stores the shared matrix twice
    if extra:
        raise CheckpointError(f"{label}: the recipe's model has no place for "
                              f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''} "
                              f"({len(extra)} tensors); check model.tie_embeddings and the "
                              "attention biases against config.json")
    owner = {p.hf_name: name for name in reversed(targets) for p in layout[name]}
    for hf_name, want in hf_shapes((tuple(t.shape), layout[n]) for n, t in targets.items()
                                   ).items():
        if tuple(files.shape(hf_name)) != want:
            raise CheckpointError(f"{label}: {hf_name} has shape {list(files.shape(hf_name))}, "
                                  f"the recipe's model needs {list(want)} (for "
                                  f"{owner[hf_name]})")
    if check_only:
        return len(needed)
    for name, t in targets.items():
        parts = layout[name]
        local, offset, shape = local_region(t)
        if local.numel():
            local.copy_(files.read_rows(parts, offset, shape).to(local.dtype))
    return len(needed)
