"""Hugging Face import and export under FSDP2 on 2 gloo processes: with meta-device init each
rank reads only its own slices and the gathered model equals a 1-process import bit for bit;
the export is written by both ranks (each its own files) and equals a 1-process export. A
whole model copied into the sharded one (``init_from`` = a kiln checkpoint) equals it too."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from kiln.checkpointing.huggingface import files as hf_files
from kiln.checkpointing.huggingface import importer as hf_import
from kiln.checkpointing.huggingface.export import export
from kiln.components import distributed
from kiln.parallelisms import ParallelismConfig, materialize, parallelize
from tests import forked
from tests.checkpointing.huggingface.hf_tiny import LLAMA3, kiln_from_hf, kiln_model, save_tiny
from tests.parallelisms.test_distributed import full_params
from tests.parallelisms.tiny import free_port, init_gloo

SHARD = "20KB"


def _worker(rank: int, port: int, tmp: str, flags: tuple[str, ...]) -> None:
    init_gloo(rank, 2, port)
    world = SimpleNamespace(world_size=2, device=torch.device("cpu"), rank=rank)
    tmp_path = Path(tmp)
    results: dict = {}
    try:
        with torch.device("meta"):
            model = kiln_model(tmp_path / "hf", 32, *flags)
        parallelize(model, ParallelismConfig(), world)
        materialize(model, "cpu", 0, mode="sharded")  # never whole on a rank
        read = []  # elements this rank read from the files
        original = hf_files.SafetensorsFolder.read

        def counting(self, name, index=()):
            t = original(self, name, index)
            read.append(t.numel())
            return t

        hf_files.SafetensorsFolder.read = counting
        folder = tmp_path / "hf"
        hf_import.load_weights(model, folder, hf_import.read_config(folder))
        hf_files.SafetensorsFolder.read = original
        results["read"] = sum(read)
        results["total"] = sum(p.numel() for p in model.parameters())
        full = full_params(model)
        if rank == 0:
            torch.save(full, tmp_path / "full.pt")
        # init_from = a kiln checkpoint: each rank copies its shard of the whole CPU model
        from kiln.recipes.loading.weights import copy_whole

        with torch.device("meta"):
            copied = kiln_model(tmp_path / "hf", 32, *flags)
        parallelize(copied, ParallelismConfig(), world)
        materialize(copied, "cpu", 1, mode="sharded")
        copy_whole(kiln_from_hf(tmp_path / "hf", 32, *flags), copied, label="whole")
        full = full_params(copied)
        if rank == 0:
            torch.save(full, tmp_path / "copied.pt")
        written = []
        save = hf_files.save_safetensors
        hf_files.save_safetensors = lambda tensors, path, metadata: (
            written.append(Path(path).name), save(tensors, path, metadata))
        export(model, None, tmp_path / "two", model_table={}, recipe_file=None,
               max_shard_size=SHARD, rank=rank, world_size=2)
        hf_files.save_safetensors = save
        results["written"] = written
    finally:
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(results))
        distributed.shutdown(together=sys.exc_info()[0] is None)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_fsdp2_import_and_export_on_two_processes_equal_one(tmp_path, family):
    """Llama with a fused wqkv (kv-grouped rows from three tensors); Qwen3-Next (per-head
    query / gate pieces, partial RoPE, norms stored as weight - 1, per-key-head in_proj groups,
    one tensor per expert)."""
    if family == "llama":
        save_tiny(tmp_path / "hf", "llama", rope_parameters=LLAMA3, vocab_size=301)  # uneven
        flags: tuple[str, ...] = ("--model.attention.fused_qkv=true",)
    else:
        from tests.checkpointing.huggingface.test_qwen3_next import _qwen3_next

        _qwen3_next(tmp_path / "hf", vocab_size=301)
        flags = ()
    forked.spawn(_worker, args=(free_port(), str(tmp_path), flags), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one = kiln_from_hf(tmp_path / "hf", 32, *flags)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    params = dict(one.named_parameters())  # (MoE's expert bias is a buffer: kept at init)
    assert full.keys() == params.keys()
    copied = torch.load(tmp_path / "copied.pt", weights_only=True)
    for name, t in params.items():
        assert torch.equal(full[name], t), name
        assert torch.equal(copied[name], t), name
    for r in ranks:  # each rank read about half of the model (whole RoPE heads: a little more)
        assert r["read"] < 0.6 * r["total"], r
    assert ranks[0]["written"] and ranks[1]["written"]
    assert not set(ranks[0]["written"]) & set(ranks[1]["written"])
    export(one, None, tmp_path / "single", model_table={}, recipe_file=None,
           max_shard_size=SHARD)
    files = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "single").iterdir())
    assert sorted(ranks[0]["written"] + ranks[1]["written"]) == [
        f for f in files if f.endswith(".safetensors")]
    for f in files:
        if f.endswith(".safetensors"):
            a, b = load_file(tmp_path / "two" / f), load_file(tmp_path / "single" / f)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f
        else:
            assert (tmp_path / "two" / f).read_text() == (tmp_path / "single" / f).read_text()
