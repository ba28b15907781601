"""The recipe of a Hugging Face model: ``kiln import`` writes the recipe matching a model's
config.json (its architecture as kiln components, its tokenizer, ``checkpoint.init_from``), and
``differences`` says where a recipe's model is not the one a config.json describes (format
conversion lives in ``checkpointing/huggingface``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

from kiln.checkpointing.huggingface import config as hf_config
from kiln.checkpointing.huggingface import importer as hf_import
from kiln.components.errors import CheckpointError, RecipeError
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from kiln.components.tokenizers.hf_tokenizer import (
    TOKENIZER_FILE,
    HuggingFaceTokenizer,
    HuggingFaceTokenizerConfig,
)
from kiln.recipes.config.files import load_recipe, to_dict, write_text_atomic
from kiln.recipes.config.loader import Layered
from kiln.recipes.config.resolve import build_config
from kiln.recipes.config.schema import Recipe

DEFAULT_SEQ_LEN = 2048


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolved_model_table(table: dict[str, Any]) -> dict[str, Any]:
    """A ``[model]`` table with every default filled in, as a recipe would resolve it."""
    return to_dict(build_config(Recipe, {"model": table}, "", Layered()))["model"]


# How training feeds attention, not what the model is: a config.json has no such setting, so a
# recipe's choice there is no difference from it.
TRAINING_ONLY = ("document_mask", "positions", "mask_kernel")
# Head counts whose 0 means "as many as n_heads" (GQA off): compared as the heads they give.
SAME_AS_HEADS = ("n_kv_heads", "n_key_heads")


def _heads_given(flat: dict[str, Any]) -> dict[str, Any]:
    out = dict(flat)
    for key, value in flat.items():
        prefix, _, name = key.rpartition(".")
        if name in SAME_AS_HEADS and value == 0:
            out[key] = flat.get(f"{prefix}.n_heads" if prefix else "n_heads", value)
    return out


def differences(config_table: dict[str, Any], recipe_table: dict[str, Any],
                source: str = "for config.json", skip: tuple[str, ...] = ()) -> list[str]:
    """``model.KEY: source's value, recipe value`` for every key where the recipe's model is
    not the one the source describes (config.json, or a kiln checkpoint's recipe; both resolved
    with defaults; a head count of 0 read as the n_heads it means); keys named in ``skip`` (the
    last part: ``TRAINING_ONLY`` for a config.json) are left out."""
    want = _heads_given(_flat(resolved_model_table(config_table)))
    have = _heads_given(_flat(recipe_table))
    return [f"model.{k}: {want.get(k)!r} {source}, {have.get(k)!r} in the recipe"
            for k in sorted(set(want) | set(have))
            if want.get(k) != have.get(k) and k.rpartition(".")[2] not in skip]


def _config_ids(config: dict[str, Any], key: str) -> list[int]:
    """config.json's ``bos_token_id`` / ``eos_token_id``: one id, a list (Llama 3.1) or none."""
    value = config.get(f"{key}_token_id")
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def tokenizer_table(source: str, folder: Path, config: dict[str, Any],
                    model_vocab: int) -> tuple[dict[str, Any], str]:
    """The ``[tokenizer]`` table for a model from ``source`` (read from its local ``folder``)
    and a note for the user ("" if none). With a tokenizer.json there: the ``huggingface``
    tokenizer on the same source, its BOS / EOS pinned to config.json's ids where the
    tokenizer's own config picks other tokens; else the byte tokenizer."""
    if not (folder / TOKENIZER_FILE).is_file():
        if model_vocab < ByteTokenizer.vocab_size:  # as written the recipe would not train
            return {"type": "byte"}, (
                f"{source} has no {TOKENIZER_FILE}, and its vocabulary ({model_vocab}) is "
                f"smaller than the byte tokenizer's ({ByteTokenizer.vocab_size}) that the "
                "recipe falls back to: set [tokenizer] to the model's own before training")
        return {"type": "byte"}, (
            f"{source} has no {TOKENIZER_FILE}; the recipe uses the byte tokenizer (ids 0-257 "
            "of the model's vocabulary): set [tokenizer] for real text")
    table: dict[str, Any] = {"type": "huggingface", "path": source}
    try:
        own = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(path=str(folder)))
    except RecipeError:  # e.g. no BOS/EOS it can name: config.json's ids name them below
        own = None
    for key in ("bos", "eos"):
        want = _config_ids(config, key)
        if want and (own is None or getattr(own, f"{key}_id") not in want):
            if own is None:
                from tokenizers import Tokenizer

                text = Tokenizer.from_file(str(folder / TOKENIZER_FILE)).id_to_token(want[0])
            else:
                text = own.id_to_token(want[0])
            if text is None:
                raise CheckpointError(f"{source}: config.json {key}_token_id = {want[0]} is not "
                                      f"an id of its {TOKENIZER_FILE}")
            table[f"{key}_token"] = text
    local = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(
        path=str(folder), **{k: v for k, v in table.items() if k.endswith("_token")}))
    if local.vocab_size > model_vocab:
        raise CheckpointError(
            f"{source}: its {TOKENIZER_FILE} has {local.vocab_size} ids, more than the model's "
            f"vocab_size ({model_vocab}); the checkpoint and its tokenizer do not belong together")
    return table, ""


def import_recipe(source: str, out: Path, *, seq_len: int = 0, ignore: tuple[str, ...] = (),
                  api=None) -> dict[str, Any]:
    """Write the recipe that trains on from ``source`` to ``out``; returns a summary."""
    folder = hf_import.source_folder(source, api=api)
    if not source.startswith("hf://"):  # paths in a recipe are read from the cwd of the run
        source = str(folder.resolve())
    config = hf_import.read_config(folder)
    model = hf_config.model_table(config, source, ignore)
    # the model's context: max_position_embeddings, or GPT-2's n_positions (its max_seq_len)
    context = config.get("max_position_embeddings") or model.get("max_seq_len")
    seq_len = seq_len or min(DEFAULT_SEQ_LEN, context or DEFAULT_SEQ_LEN)
    tokenizer, tokenizer_note = tokenizer_table(source, folder, config, model["vocab_size"])
    checkpoint: dict[str, Any] = {"init_from": source}
    if ignore:
        checkpoint["init_from_ignore"] = list(ignore)
    recipe = {
        "description": f"continued pretraining from {source} ({config['model_type']})",
        "training": {"seq_len": seq_len, "steps": 100, "global_batch": 8, "micro_batch": 1},
        "model": model,
        "tokenizer": tokenizer,
        "optimizer": {"type": "adamw", "lr": 3e-5, "weight_decay": 0.1,
                      "schedule": {"type": "warmup_cosine", "warmup_steps": 10,
                                   "min_lr_ratio": 0.1}},
        "checkpoint": checkpoint,
    }
    header = (f"# Written by `kiln import {source}`: the architecture of its config.json. Its "
              "weights load when\n# training starts (checkpoint.init_from). Train with "
              f"./run_train.sh {out}\n")
    write_text_atomic(Path(out), header + tomli_w.dumps(recipe))
    load_recipe(out)  # the written recipe must load; an error here is a bug in this function
    return {"family": config["model_type"], "params": _flat(model), "seq_len": seq_len,
            "tokenizer": tokenizer["type"], "note": tokenizer_note}
