"""What a failed save says: the cause found inside DCP's wrapper, "no space left" for torch's
errno-less zip-writer error on a nearly full disk, and two ranks that agree (one rank's failure
stops both, with the same message, and neither hangs in a collective)."""

from __future__ import annotations

import errno
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from kiln.checkpointing.unattended import save_failure
from kiln.components import distributed
from kiln.components.distributed import World
from kiln.components.errors import CheckpointError
from tests import forked


def test_the_cause_is_found_inside_dcps_wrapper(tmp_path):
    inner = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save failed", {0: (inner, None)})
    assert save_failure.describe(wrapped, tmp_path).startswith("no space left on device: the "
                                                              "file system at /")
    other = CheckpointException("save failed", {0: (PermissionError(13, "denied"), None)})
    assert save_failure.describe(other, tmp_path) == "PermissionError: [Errno 13] denied"


def test_an_errno_less_write_error_on_a_nearly_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    pos = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 0))
    assert save_failure.describe(pos, tmp_path).endswith("has 0 bytes free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 1 << 40))
    assert save_failure.describe(pos, tmp_path).startswith("RuntimeError: [enforce fail")


def _one_rank_fails(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from kiln.checkpointing import storage
    from kiln.checkpointing.manager import CheckpointManager
    from tests.checkpointing.toy import toy_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        world = World(rank, 2, rank, torch.device("cpu"))
        s = toy_state()
        s.world = world
        s.train_step()
        m = CheckpointManager(Path(root), world, log=lambda line: None)
        save_rank_file = storage.save_rank_file
        if rank == 1:
            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            storage.save_rank_file = full
        try:
            m.save(s)
            outcome = "saved"
        except CheckpointError as exc:
            outcome = str(exc).splitlines()[0]
        storage.save_rank_file = save_rank_file
        s.train_step()
        after = m.save(s).name  # both ranks are still in step: the next save works
        Path(root, f"rank{rank}.json").write_text(json.dumps([outcome, after]))
    finally:
        distributed.shutdown(together=sys.exc_info()[0] is None)


@pytest.mark.slow
def test_one_ranks_failure_stops_every_rank_with_one_message(tmp_path):
    from tests.parallelisms.tiny import free_port

    forked.spawn(_one_rank_fails, args=(free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    assert r0[0].startswith("checkpoint step 1 FAILED (rank 1: no space left on device: ")
    assert "there is no earlier checkpoint; the partial save was removed" in r0[0]
    assert r0[1] == "step_0000002"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
