"""The checkpoint manager on a toy train state: exact continuation, async saves, damaged
folders, a save killed mid-write, weights-only and EMA resume, terminal guard state."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from kiln.checkpointing import layout
from kiln.checkpointing.manager import CheckpointManager, rank_file
from kiln.components.distributed import World
from kiln.components.errors import CheckpointError
from tests.checkpointing.toy import toy_state


def manager(root, **kw):
    return CheckpointManager(root, World(0, 1, 0, torch.device("cpu")), log=lambda s: None, **kw)


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_continues_bit_identically(tmp_path, async_save):
    a = toy_state(carry=True, two_optimizers=True)
    m = manager(tmp_path, async_save=async_save)
    for _ in range(3):
        a.train_step()
    m.save(a)
    expected = [a.train_step() for _ in range(4)]  # trains while an async save finishes
    m.wait()
    b = toy_state(seed=9, carry=True, two_optimizers=True)  # different weights, RNG, cursor
    loaded = manager(tmp_path).load(b, tmp_path / "step_0000003")
    assert loaded.step == 3 and b.progress.step == 3 and b.train_loader.cursor == 3
    assert b.guards["spike"].ema is not None
    assert [b.train_step() for _ in range(4)] == expected


def test_layout_latest_index_and_rotation(tmp_path):
    s = toy_state()
    m = manager(tmp_path, keep_last=2)
    for _ in range(4):
        s.train_step()
        m.save(s)
    assert (tmp_path / "latest").read_text().strip() == "step_0000004"
    assert [p.name for _, p in layout.list_checkpoints(tmp_path)] == ["step_0000003",
                                                                      "step_0000004"]
    m.mark_final(4)
    s.train_step()
    m.save(s)
    s.train_step()
    m.save(s)
    m.wait()  # the rotated-out folder is deleted in the background; wait() joins that
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["final", "index.json", "latest", "step_0000004", "step_0000005",
                     "step_0000006"]
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["final"] == "step_0000004" and index["latest"] == "step_0000006"
    files = set(os.listdir(tmp_path / "step_0000006"))
    assert {"state.json", "manifest.json", ".metadata", "rank_00000.safetensors"} <= files


@pytest.fixture
def saved(tmp_path):
    s = toy_state()
    s.train_step()
    manager(tmp_path).save(s)
    return tmp_path / "step_0000001"


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda f: _flip_byte(f / "__0_0.distcp"), "checksum"),
    (lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:100]),
     "truncated"),
    (lambda f: (f / "rank_00000.safetensors").unlink(), "missing"),
    (lambda f: (f / "manifest.json").unlink(), "renamed into place only once"),
    (lambda f: (f / "state.json").write_text("{}"), "truncated or overwritten"),
])
def test_damaged_checkpoints_are_refused_before_anything_changes(saved, damage, message):
    damage(saved)
    s = toy_state(seed=4)
    before = [p.detach().clone() for p in s.model.parameters()]
    with pytest.raises(CheckpointError, match=message):
        manager(saved.parent).load(s, saved)
    assert all(torch.equal(a, b) for a, b in zip(before, s.model.parameters(), strict=True))


def _reseal(folder):
    layout.write_manifest(folder, json.loads((folder / "manifest.json").read_text())["step"])


def edit_rank_header(folder, edit) -> None:
    """Change rank 0's JSON header with ``edit(header)``, then reseal the manifest (as someone
    who knows the format would)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = rank_file(folder, 0)
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["kiln"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(meta)
    save_file(tensors, str(path), metadata={"kiln": json.dumps(meta)})
    _reseal(folder)


def test_a_resealed_tampered_payload_is_still_refused(saved):
    edit_rank_header(saved, lambda meta: meta["payload"].update(step=7))
    with pytest.raises(CheckpointError, match="does not match the train progress step 1"):
        manager(saved.parent).load(toy_state(), saved)


def test_a_changed_model_is_a_clear_error(saved):
    s = toy_state()
    s.model.out = torch.nn.Linear(16, 5)
    s.optimizers = {"main": torch.optim.AdamW(s.model.parameters())}
    with pytest.raises(CheckpointError, match="do not fit this model"):
        manager(saved.parent).load(s, saved)


def test_another_world_size_needs_a_layout_to_map_per_rank_state(saved):
    s = toy_state()  # no ``layout``: it cannot say which batch rows it trains
    s.world = World(0, 2, 0, torch.device("cpu"))
    m = CheckpointManager(saved.parent, World(0, 1, 0, torch.device("cpu")))
    m.world = s.world  # pretend: a 2-process run reading a 1-process checkpoint
    with pytest.raises(CheckpointError, match="saved by 1 processes, this run has 2.*rows"):
        m.load(s, saved)


def test_aborted_guard_refuses_full_resume_but_allows_weights_only(tmp_path):
    s = toy_state()
    s.train_step()
    s.guards["spike"].aborted = True
    manager(tmp_path).save(s)
    with pytest.raises(CheckpointError, match="aborted training"):
        manager(tmp_path).load(toy_state(), tmp_path / "step_0000001")
    fresh = toy_state(seed=3)
    loaded = manager(tmp_path).load(fresh, tmp_path / "step_0000001", weights_only=True)
    assert loaded.weights_only and fresh.progress.step == 0
    assert fresh.guards["spike"].aborted is False and fresh.guards["spike"].ema is None
    assert all(torch.equal(a, b) for a, b in
               zip(s.model.parameters(), fresh.model.parameters(), strict=True))
    assert not fresh.optimizers["main"].state  # fresh moments


class EmaAdamW(torch.optim.AdamW):
    """AdamW keeping an EMA of the weights in its state (like kiln's EMA-capable optimizers)."""

    def step(self, closure=None):
        super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st["ema"] = p.detach().clone() if "ema" not in st else st["ema"].lerp(p, 0.5)

    def swap_ema(self):
        for g in self.param_groups:
            for p in g["params"]:
                ema = self.state[p]["ema"]
                tmp = p.detach().clone()
                p.data.copy_(ema)
                ema.copy_(tmp)


def test_weights_only_from_ema(tmp_path):
    s = toy_state()
    s.optimizers = {"main": EmaAdamW(s.model.parameters(), lr=1e-2)}
    for _ in range(3):
        s.train_step()
    manager(tmp_path).save(s)
    emas = [s.optimizers["main"].state[p]["ema"].clone() for p in s.model.parameters()]
    fresh = toy_state(seed=2)
    fresh.optimizers = {"main": EmaAdamW(fresh.model.parameters(), lr=1e-2)}
    manager(tmp_path).load(fresh, tmp_path / "step_0000003", weights_only=True, from_ema=True)
    assert all(torch.equal(e, p) for e, p in zip(emas, fresh.model.parameters(), strict=True))
    assert not fresh.optimizers["main"].state
    plain = toy_state(seed=2)
    with pytest.raises(CheckpointError, match="EMA"):
        manager(tmp_path).load(plain, tmp_path / "step_0000003", weights_only=True,
                               from_ema=True)


def _save_then_die(root: str, where: str) -> None:
    """Child: one good checkpoint at step 1, then SIGKILL in the middle of saving step 2."""
    import kiln.checkpointing.layout as lay
    import kiln.checkpointing.storage as sto

    s = toy_state()
    s.train_step()
    m = manager(root)
    m.save(s)
    s.train_step()

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "tensors":
        from torch.distributed.checkpoint import FileSystemWriter

        original = FileSystemWriter.write_data

        def partial(self, plan, planner):  # write half of a file, then die
            (lay.Path(self.path) / "__0_0.distcp").write_bytes(b"\0" * 64)
            die()
            return original(self, plan, planner)

        FileSystemWriter.write_data = partial
    elif where == "manifest":
        lay.checksum = die  # while sealing
    elif where == "rank_file":
        sto.save_rank_file = die
    m.save(s)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["rank_file", "tensors", "manifest"])
def test_a_save_killed_mid_write_leaves_the_last_checkpoint_loadable(tmp_path, where):
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_save_then_die, args=(str(tmp_path), where))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert (tmp_path / ".tmp-step_0000002").is_dir()  # the interrupted save
    assert layout.newest_complete(tmp_path).name == "step_0000001"
    s = toy_state(seed=5)
    assert manager(tmp_path).load(s, tmp_path / "step_0000001").step == 1
    s.train_step()
    manager(tmp_path).save(s)  # the next save cleans the leftovers
    assert not (tmp_path / ".tmp-step_0000002").exists()
    assert layout.newest_complete(tmp_path).name == "step_0000002"


def test_a_fused_wqkv_saved_in_the_old_row_order_is_refused(saved):
    """v0.1 stacked a fused wqkv as [q; k; v]; its rows are now kv-grouped, so a checkpoint
    without the marker would load permuted weights: refused when the model has a wqkv."""
    state_file = saved / "state.json"
    meta = json.loads(state_file.read_text())
    assert meta.pop("qkv_rows") == "kv_grouped"
    state_file.write_text(json.dumps(meta))
    _reseal(saved)
    manager(saved.parent).load(toy_state(seed=4), saved)  # no wqkv: unaffected
    s = toy_state(seed=4)
    s.model.wqkv = torch.nn.Linear(16, 48)
    with pytest.raises(CheckpointError, match=r"fused wqkv rows were \[q; k; v\]"):
        manager(saved.parent).load(s, saved)


def test_optimizer_groups_are_compared_by_name_not_by_how_parallelism_splits_them(tmp_path):
    from kiln.checkpointing.load_checks import check_groups

    saved = [{"name": "main", "params": ["a", "b"]}, {"name": "main/no_decay", "params": ["n"]}]
    by_mesh = [{"name": "main", "params": ["a"]}, {"name": "main", "params": ["b"]},
               {"name": "main/no_decay", "params": ["n"]}]  # expert parallel: one group per mesh
    check_groups(tmp_path, "main", saved, by_mesh)
    moved = [{"name": "main", "params": ["a"]}, {"name": "main/no_decay", "params": ["b", "n"]}]
    with pytest.raises(CheckpointError, match=r"groups \{'main': 2, 'main/no_decay': 1\} -> "):
        check_groups(tmp_path, "main", saved, moved)
    with pytest.raises(CheckpointError, match="only saved: b; only now: c"):
        check_groups(tmp_path, "main", saved, [{"name": "main", "params": ["a", "c"]},
                                                 {"name": "main/no_decay", "params": ["n"]}])


def _full_disk(monkeypatch, error):
    """DCP's writer writes part of a file, then fails with ``error`` (what a full disk does)."""
    from torch.distributed.checkpoint import FileSystemWriter

    def write_data(self, plan, planner):
        (Path(self.path) / "__0_0.distcp").write_bytes(b"\0" * 64)
        raise error

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


ENOSPC = OSError(errno.ENOSPC, "No space left on device")
UNEXPECTED_POS = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs "
                              "598")  # torch's zip writer on a full disk: no errno


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_is_one_error_naming_the_intact_checkpoint(tmp_path, monkeypatch,
                                                               async_save):
    """Before: the sync save raised the writer's raw error; the async one's CheckpointException
    (a BaseException) slipped past `except Exception` in wait()."""
    s = toy_state()
    s.train_step()
    m = manager(tmp_path, async_save=async_save)
    m.save(s)
    m.wait()  # step 1 written before the disk fills up
    s.train_step()
    _full_disk(monkeypatch, ENOSPC)
    expected = (r"checkpoint step 2 FAILED \(no space left on device: the file system at .* has "
                r".* free\); the previous checkpoint step 1 is intact .*; the partial save was "
                r"removed\.\nFree space there")
    with pytest.raises(CheckpointError, match=expected):
        m.save(s)
        m.wait()  # an async save reports at the next save, the end of training, or here
    assert sorted(p.name for p in tmp_path.iterdir() if "step" in p.name) == ["step_0000001"]
    monkeypatch.undo()
    assert manager(tmp_path).load(toy_state(seed=3), tmp_path / "step_0000001").step == 1


def test_continue_on_a_failed_save_and_the_cause_without_an_errno(tmp_path, monkeypatch):
    s = toy_state()
    s.train_step()
    lines = []
    m = CheckpointManager(tmp_path, World(0, 1, 0, torch.device("cpu")), log=lines.append,
                          on_error="continue")
    _full_disk(monkeypatch, UNEXPECTED_POS)
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 100))
    assert m.save(s) is None  # training goes on
    assert "checkpoint step 1 FAILED (no space left on device" in lines[0]
    assert "has 100 bytes free); there is no earlier checkpoint" in lines[0]
    assert "training goes on" in lines[1]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, free))
    assert m.save(s) is None  # another cause: named as it is
    assert "FAILED (RuntimeError: [enforce fail at inline_container.cc:672]" in lines[2]
    # the last save of a run must succeed; its advice is not the full disk's
    with pytest.raises(CheckpointError, match=r"checkpoint step 1 FAILED \(RuntimeError.*\n"
                                              r"Remove the cause above"):
        m.save(s, final=True)
    monkeypatch.undo()
    s.train_step()
    assert m.save(s) == tmp_path / "step_0000002" and layout.is_complete(m.save(s))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_saves_and_loads_run_with_automatic_gc_paused():
    import gc

    from kiln.checkpointing import manager as manager_module

    seen = []

    @manager_module._gc_paused()
    def body():
        seen.append(gc.isenabled())

    assert gc.isenabled()
    body()
    assert seen == [False] and gc.isenabled()  # restored
    gc.disable()
    try:
        body()
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()
    for method in (CheckpointManager.save, CheckpointManager.load):
        assert hasattr(method, "__wrapped__"), method  # both wear the decorator
