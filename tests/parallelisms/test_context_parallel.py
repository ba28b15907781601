"""Context parallelism (``parallelism.cp``): the load-balanced chunks, the refusals, and gloo
processes against one process — cp = 2 equals one process to rtol 1e-5 with and without the
document mask, with learned absolute positions and with per-block compile, checkpoints move
between cp = 2 and cp = 1 both ways, and cp 2 x tp 2 on four processes. One spawn per world size
runs all its parts (the multi-process tests are few)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from kiln.components.errors import RecipeError
from kiln.parallelisms.context_parallel import ContextParallel, chunk_positions
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.model_inputs import ModelInputs
from tests import forked
from tests.checkpointing.elastic import StopAfter
from tests.components.data.conftest import write_corpus
from tests.conftest import CONFIGS
from tests.parallelisms.tiny import free_port, rank_env
from tests.recipes.test_combinations import DENSE, FAMILIES, TINY

N, K = 4, 2  # steps; the cut runs save at K and stop
MASK = ("--model.attention.document_mask=true", "--model.attention.positions=per_document")


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))
    # causal work: the keys at or before each rank's queries sum to the same count
    work = [int((chunk_positions(24, 3, r) + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1
    cp = ContextParallel(group=None, rank=0, size=2)
    order = cp._sequence_order(8, torch.device("cpu"))  # the rank-order gather [0,1,6,7,2,3,4,5]
    assert torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])[order].tolist() == list(range(8))
    with pytest.raises(ValueError, match="2 x 2 chunks"):
        chunk_positions(10, 2, 0)


def test_model_inputs_keep_this_ranks_tokens_and_the_whole_rows_documents():
    cp = SimpleNamespace(size=2, positions=lambda n, d: chunk_positions(n, 2, 1, d),
                         gatherer=lambda n, d: lambda t: t,
                         describe=lambda: "context parallel 2")
    attention = SimpleNamespace(document_mask=True, positions="sequence", mask_kernel="auto")
    inputs = ModelInputs(attention, torch.device("cpu"), cp=cp)
    ids = torch.arange(16).view(2, 8)
    batch = {"input_ids": ids, "labels": ids + 1, "doc_ids": (ids % 8 >= 4).int()}
    got_ids, labels, extra = inputs(batch)
    assert got_ids.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and torch.equal(labels, got_ids + 1)
    ctx = extra["context"]
    assert ctx.rope_positions.tolist() == [2, 3, 4, 5] and ctx.mask.shape == (2, 1, 4, 8)
    visible = (ctx.mask[0, 0] == 0).int().tolist()
    assert visible == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0],
                       [0, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0]]
    assert "document mask + context parallel 2" in inputs.describe()


def _recipe(folder, *extra):
    return load_recipe(CONFIGS / "debug.toml", [*TINY, *DENSE, f"--run.folder={folder}", *extra])


def test_bad_degrees_and_lengths_are_recipe_errors_naming_keys_and_values(tmp_path):
    from kiln.recipes.commands.validate import describe
    from kiln.recipes.training.trainer import Trainer

    with pytest.raises(RecipeError, match=r"parallelism.cp = 2 does not divide the world size "
                                          r"1; valid values: \[1\]"):
        Trainer(_recipe(tmp_path / "r", "--parallelism.cp=2"))
    with pytest.raises(RecipeError, match=r"training.seq_len = 30 does not split: parallelism.cp "
                                          r"= 2 cuts every sequence into 2 x 2 chunks; valid "
                                          r"values are multiples of 4, e.g. 28 or 32"):
        describe(_recipe(tmp_path / "r", "--parallelism.cp=2", "--training.seq_len=30"), 2)
    warm = ("--parallelism.cp=2", "--parallelism.tp=4", "--training.context_warmup.steps=5",
            "--training.context_warmup.multiple=4", "--training.context_warmup.start=8")
    with pytest.raises(RecipeError, match=r"training.context_warmup.multiple = 4 \(every warmup "
                                          r"length is a multiple of it\) does not split.*tp = 4 "
                                          r"splits each rank's T / cp.*multiples of 8"):
        describe(_recipe(tmp_path / "r", *warm), 8)
    with pytest.raises(RecipeError, match="model.carry = true cannot run with parallelism.cp"):
        describe(load_recipe(CONFIGS / "looped_moe_debug.toml",
                             ["--model.carry=true", "--parallelism.cp=2"]), 2)


def test_validate_shows_cp_in_the_mesh_and_activation_memory(tmp_path):
    from kiln.recipes.commands.validate import describe

    text = describe(_recipe(tmp_path / "r", "--parallelism.cp=2", *MASK), 2)
    assert "mesh dp_replicate 1 x dp_shard 1 x cp 2 x tp 1 = 2 ranks" in text
    assert "context parallel 2" in text and "activations by parallelism.cp" in text, text


# ------------------------------------------------------------------ gloo processes vs one
def _record(recipe, stop_after=None) -> tuple[list[float], str]:
    from kiln.recipes.training.trainer import Trainer
    from tests.recipes.test_combinations import Record

    record, out = Record(), io.StringIO()
    Trainer(recipe, hooks=[record, StopAfter(stop_after)], out=out).fit()
    return record.losses, out.getvalue()


def _case(folder, corpus, *extra):
    """The dense tiny recipe on short documents (many boundaries per row), N steps, saved."""
    return _recipe(folder, "--data.source=folder", f"--data.source_path={corpus}",
                   f"--training.steps={N}", "--checkpoint.enable=true",
                   f"--checkpoint.interval={K}", *extra)


# gpt2: learned absolute positions, each rank adding the rows of its own positions
# (without its dropout: each rank draws the masks of its own chunks)
GPT2 = tuple(f for f in FAMILIES["gpt2"][1] if "dropout" not in f)
# window: sliding-window attention (5 tokens) with gpt-oss's learned sinks beside the document
# mask, each rank's queries windowed over the gathered keys
# latent: DeepSeek's latent attention, each rank gathering the latents, not the expanded keys
LATENT = ("--model.attention.type=latent", "--model.attention.kv_rank=16",
          "--model.attention.nope_head_dim=8", "--model.attention.rope_head_dim=8")
SINKS = ("--model.attention.window=5", "--model.attention.sinks=true", *MASK)
TWO = {"plain": (), "gpt2": GPT2, "window": SINKS,
       "latent": (*LATENT, *MASK), "mask": MASK}  # mask last: its log is read


def _worker(rank: int, world: int, port: int, folder: str, parts: dict) -> None:
    from kiln.components import distributed

    rank_env(rank, world, port)
    corpus = f"{folder}/corpus"
    results = {}
    try:
        for name, (run, extra, stop) in parts.items():
            results[name] = _record(_case(f"{folder}/{run}", corpus, *extra), stop)
    finally:
        with open(f"{folder}/{world}_rank{rank}.json", "w") as f:
            json.dump(results, f)
        distributed.shutdown(together=sys.exc_info()[0] is None)


def _spawn(world: int, folder, parts: dict) -> list[dict]:
    forked.spawn(_worker, args=(world, free_port(), str(folder), parts),
                 nprocs=world)
    return [json.loads((folder / f"{world}_rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_two_processes_cp2_equal_one_and_checkpoints_move_between_cp2_and_cp1(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_docs=80)
    ref = {}
    for name, extra in TWO.items():
        ref[name], out = _record(_case(tmp_path / f"one_{name}", corpus, *extra))
        assert len(ref[name]) == N
    assert "attention: document mask" in out
    assert ref["mask"] != pytest.approx(ref["plain"], rel=1e-4)  # the mask changes the result
    _record(_case(tmp_path / "one_cut", corpus, *MASK), stop_after=K)  # continued on cp = 2
    parts = {name: (f"cp2_{name}", ("--parallelism.cp=2", *extra), None)
             for name, extra in TWO.items()}
    parts["cut"] = ("cp2_cut", ("--parallelism.cp=2", *MASK), K)  # continued on one process
    parts["one_to_cp2"] = ("one_cut", ("--parallelism.cp=2", *MASK), None)
    # per-block torch.compile traces the K/V all-gather (a functional collective) into the block,
    # forward and backward; aot_eager runs the traced graphs as they are (inductor's C++ kernels,
    # about 25 s of g++ on each rank here, are tests/parallelisms/test_compile.py's subject)
    parts["compile"] = ("cp2_compile", ("--parallelism.cp=2", "--parallelism.compile=true",
                                        "--parallelism.compile_backend=aot_eager", *MASK), None)
    ranks = _spawn(2, tmp_path, parts)
    for name in TWO:
        for r in range(2):
            losses, out = ranks[r][name]
            assert losses == pytest.approx(ref[name], rel=1e-5), (name, r, losses, ref[name])
        assert "context parallel 2" in ranks[0][name][1]
    losses, out = ranks[0]["compile"]
    assert losses == pytest.approx(ref["mask"], rel=1e-5), losses
    assert "compile per block (aot_eager)" in out, out
    losses, out = ranks[0]["one_to_cp2"]
    assert losses == pytest.approx(ref["mask"][K:], rel=1e-5), losses
    assert "layout: 1 process -> 2 processes" in out, out
    shutil.copytree(tmp_path / "cp2_cut", tmp_path / "cp2_to_one")
    losses, out = _record(_case(tmp_path / "cp2_to_one", corpus, *MASK))
    assert losses == pytest.approx(ref["mask"][K:], rel=1e-5), losses
    assert "cp=2" in out and "-> 1 process" in out, [x for x in out.splitlines() if "layout" in x]


@pytest.mark.slow
def test_four_processes_cp2_tp2_equal_one(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_docs=80)
    ref, _ = _record(_case(tmp_path / "one", corpus, *MASK))
    ranks = _spawn(4, tmp_path, {"cp2_tp2": ("cp2_tp2", ("--parallelism.cp=2",
                                                         "--parallelism.tp=2", *MASK), None)})
    for r in range(4):
        losses, out = ranks[r]["cp2_tp2"]
        assert losses == pytest.approx(ref, rel=1e-5), (r, losses, ref)
    assert "tensor parallel 2" in ranks[0]["cp2_tp2"][1]
