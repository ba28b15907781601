"""Does a model divide over a mesh layout? Every problem named by its recipe key.

Used by ``parallelize`` before anything is sharded, by the trainer (sequence lengths) and by
``kiln validate --world-size`` (the layout planner), so a layout that cannot work is refused
with the same words on a laptop and on the cluster.
"""

from __future__ import annotations

import math

from torch import nn

from kiln.components.errors import RecipeError
from kiln.parallelisms.blocks import model_blocks


def _divides(problems: list[str], value: int, what: str, degree: int, key: str,
             note: str = "") -> None:
    if value % degree:
        line = f"{what} = {value}{note} is not divisible by parallelism.{key} = {degree}"
        if line not in problems:
            problems.append(line)


def model_problems(model: nn.Module, tp: int, ep: int = 1, cp: int = 1) -> list[str]:
    """Dimensions of ``model`` that ``tp`` tensor-parallel ranks or ``ep`` expert-parallel
    ranks cannot split evenly; what ``cp`` context-parallel ranks cannot run."""
    problems: list[str] = []
    if ep > 1:
        _expert_problems(problems, model, ep)
    if cp > 1 and getattr(model, "carry", None) is not None:
        problems.append(
            f"model.carry = true cannot run with parallelism.cp = {cp}: the carry is each row's "
            "final state per token, but context parallel splits a row's tokens over ranks (the "
            "checkpoint regroups the carry by whole rows, and carry_reset_token would see only "
            "a rank's chunks); set model.carry = false or parallelism.cp = 1")
    if getattr(model, "mtp", None) is not None and max(tp, ep, cp) > 1:
        degree = next(f"parallelism.{n} = {d}" for n, d in (("tp", tp), ("ep", ep), ("cp", cp))
                      if d > 1)
        problems.append(
            f"model.mtp_depth cannot run with {degree} yet: the multi-token prediction modules "
            "are not split by it (their targets lie k tokens ahead, across context-parallel "
            "chunks); set model.mtp_depth = 0 (FSDP2 runs them)")
    linear = [b for b in model_blocks(model) if hasattr(getattr(b, "attention", None), "A_log")]
    if linear and (cp > 1 or tp > 1):
        degree = f"parallelism.cp = {cp}" if cp > 1 else f"parallelism.tp = {tp}"
        problems.append(
            f"Gated DeltaNet layers cannot run with {degree} yet: its state runs through the "
            "whole sequence (context parallel would split it over ranks) and its heads are not "
            "split for tensor parallel; set parallelism.cp = 1 and parallelism.tp = 1 (FSDP2 "
            "runs it)")
    if tp <= 1:
        return problems
    if getattr(model, "pos_embeddings", None) is not None:
        problems.append(
            f"model.absolute_positions = true cannot run with parallelism.tp = {tp} yet: the "
            "position table is added after the token embeddings, whose output tensor parallel "
            "splits by sequence; set parallelism.tp = 1 (FSDP2, context and pipeline parallel "
            "run it)")
    if any(getattr(getattr(b, "attention", None), "sinks", None) is not None
           for b in model_blocks(model)):
        problems.append(
            f"model.attention.sinks = true cannot run with parallelism.tp = {tp} yet: the "
            "per-head sink logits are not split with the heads; set parallelism.tp = 1 (FSDP2, "
            "context and pipeline parallel run them)")
    if any(hasattr(getattr(b, "attention", None), "wkv_b") for b in model_blocks(model)):
        problems.append(
            f"model.attention.type = \"latent\": latent attention cannot run with "
            f"parallelism.tp = {tp} yet: its latent and shared rope key feed every head, so "
            "their gradients would need summing over the ranks' heads; set parallelism.tp = 1 "
            "(FSDP2 and context parallel run it)")
    vocab = getattr(model, "vocab_size", None)
    if vocab:
        _divides(problems, vocab, "model.vocab_size", tp, "tp",
                 " (0 takes the tokenizer's; the embedding and head rows)")
    for block in model_blocks(model):
        attn, ffn = getattr(block, "attention", None), getattr(block, "feed_forward", None)
        if attn is not None and hasattr(attn, "n_heads"):
            _divides(problems, attn.n_heads, "model.attention.n_heads", tp, "tp")
            kv = getattr(attn, "n_kv_heads", attn.n_heads)
            _divides(problems, kv, "model.attention.n_kv_heads", tp, "tp", " (0 = n_heads)")
        if ffn is not None and hasattr(ffn, "w1") and hasattr(ffn.w1, "out_features"):
            _divides(problems, ffn.w1.out_features, "model.ffn.hidden_dim", tp, "tp",
                     " (the feed-forward hidden width; 0 derives it)")
    return problems


def _expert_problems(problems: list[str], model: nn.Module, ep: int) -> None:
    from kiln.components.ffn.moe import moe_layers

    layers = moe_layers(model)
    if not layers:
        problems.append(f"parallelism.ep = {ep} needs MoE layers (model.ffn.type = \"moe\"); "
                        "this model has none: set parallelism.ep = 1")
    for layer in layers:
        _divides(problems, layer.n_experts, "model.ffn.n_experts", ep, "ep")
    if any(hasattr(layer, "w13") for layer in layers):
        problems.append(f"model.ffn.experts = \"gpt_oss\" cannot run with parallelism.ep = {ep} "
                        "yet: the all-to-all kernels hold bias-free SwiGLU experts; set "
                        "parallelism.ep = 1")


def training_problems(training, tp: int, cp: int = 1) -> list[str]:
    """``[training]`` lengths that context parallelism (T in ``2 cp`` chunks, two per rank) and
    sequence parallelism (a rank's T / cp split over ``tp`` ranks) cannot split."""
    problems: list[str] = []
    if cp <= 1:
        if tp > 1:
            _divides(problems, training.seq_len, "training.seq_len", tp, "tp",
                     " (sequence-parallel slices)")
            if training.context_warmup.steps:
                _divides(problems, training.context_warmup.multiple,
                         "training.context_warmup.multiple", tp, "tp",
                         " (every warmup length is a multiple of it)")
        return problems
    unit = math.lcm(2 * cp, cp * tp)
    lengths = [("training.seq_len", training.seq_len, "")]
    if training.context_warmup.steps:
        lengths.append(("training.context_warmup.multiple", training.context_warmup.multiple,
                        " (every warmup length is a multiple of it)"))
    for key, value, note in lengths:
        if value % unit:
            near = sorted({max(unit, value // unit * unit), -(-value // unit) * unit})
            problems.append(f"{key} = {value}{note} does not split: {_unit_text(tp, cp)}; valid "
                            f"values are multiples of {unit}, e.g. {' or '.join(map(str, near))}")
    return problems


def _unit_text(tp: int, cp: int) -> str:
    parts = [f"parallelism.cp = {cp} cuts every sequence into 2 x {cp} chunks"]
    if tp > 1:
        parts.append(f"parallelism.tp = {tp} splits each rank's T / cp into {tp} "
                     "sequence-parallel slices")
    return " and ".join(parts)


def raise_problems(problems: list[str], layout_text: str) -> None:
    if problems:
        raise RecipeError(
            f"the layout {layout_text} does not fit the model:\n  " + "\n  ".join(problems)
            + "\nchange those keys or pick other parallelism degrees "
            "(`kiln validate RECIPE --world-size N` checks a layout without training)"
        )


def chunked_loss_note(training, tp: int) -> str:
    """Why ``training.loss_chunk_tokens`` is not used under tensor parallel ("" when it is)."""
    if tp <= 1 or not getattr(training, "loss_chunk_tokens", 0):
        return ""
    return (f"training.loss_chunk_tokens = {training.loss_chunk_tokens} not used with "
            f"parallelism.tp = {tp}: the head's logits are sharded over the vocabulary (the "
            "chunked head needs a chunk's whole logits); loss parallel keeps them sharded")
