"""Process-group setup and the collectives kiln uses (torchrun environment).

Every collective in kiln goes through the helpers here (tests/test_imports.py checks the
source). Each helper hands the collective a tensor on the process group's device -- the current
accelerator for NCCL / HCCL / XCCL, which take device tensors only; the CPU for gloo -- and
copies the result back to the caller's tensor, so call sites never need to know the backend.
Outside a process group (one process) every helper is the identity. ``all_gather_autograd`` is
torch's functional all-gather (traceable by ``torch.compile``, with a reduce-scatter backward).

A leaf module: every package may import it; it imports only ``kiln.components.devices`` (the
device layer, itself a leaf) and ``kiln.components.errors``.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.components import devices

JOIN_S = 600.0  # the least time ``init`` waits for every rank to join the group

@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init(device_choice: str = "auto", backend: str = "auto", *, timeout_s: float = 1800.0,
         flight_recorder: int = 0) -> World:
    """Join the torchrun process group if there is one (WORLD_SIZE > 1).

    ``backend`` "auto" is the device type's library (``devices.BACKENDS``); ``timeout_s`` is how
    long a collective may wait for its peers before it fails; ``flight_recorder`` entries (0 =
    off) keep the last collectives of each group for a hang report (``TORCH_FR_BUFFER_SIZE``,
    unless the environment sets it). Both take effect only in the first call that creates the
    group: a later call finds it up and changes nothing."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = devices.pick_device(device_choice, world_size=world_size)
    devices.set_current(device)
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = devices.backend_for(device.type)
        # read by torch when the group is created (either name); unset, torch keeps 2000
        if not any(os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE",
                                               "TORCH_NCCL_TRACE_BUFFER_SIZE")):
            os.environ["TORCH_FR_BUFFER_SIZE"] = str(flight_recorder)
        # The join (every rank's address through the store) waits with the same timeout as
        # the collectives; ranks reach it seconds apart on a busy machine (imports, a slow
        # filesystem), so it gets at least JOIN_S, and the group the recipe's timeout after it.
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        join_s = max(timeout_s, JOIN_S) if set_timeout is not None else timeout_s
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(seconds=join_s),
            device_id=device if device.type not in ("cpu", "mps") else None,
        )
        if join_s != timeout_s:
            set_timeout(datetime.timedelta(seconds=timeout_s))
    return World(rank, world_size, local_rank, device)


def shutdown(*, together: bool = True) -> None:
    """Leave the process group. ``together``: first wait (bounded) until every rank is here,
    because a rank tearing down gloo connections that a peer still uses can abort the peer
    ("terminate called without an active exception"). Pass False when leaving on an error."""
    if not is_initialized():
        return
    if together and dist.get_world_size() > 1:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        else:
            dist.barrier()
    dist.destroy_process_group()


def is_initialized() -> bool:
    """True inside a process group (torchrun with WORLD_SIZE > 1, or a test's gloo group)."""
    return dist.is_available() and dist.is_initialized()


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a collective on ``group`` (default: the world) takes its tensors on."""
    if not is_initialized():
        return torch.device("cpu")
    # also "cpu:gloo,cuda:nccl": device tensors take the accelerator's route
    return devices.device_of_backend(dist.get_backend(group))


def _staged(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``t`` itself when it already sits contiguous on the group's device, else a copy there."""
    return t.to(group_device(group)).contiguous()


def _copy_back(t: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    if work is not t:
        t.copy_(work)
    return t


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if is_initialized():
        dist.barrier(group=group)


def all_reduce_(t: torch.Tensor, op: str = "sum",
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``t`` in place over ``group`` (``op``: sum, max or min; gloo has no average)."""
    if op not in ("sum", "max", "min"):
        raise ValueError(f"all_reduce_: op {op!r} is not one of sum, max, min")
    if not is_initialized():
        return t
    work = _staged(t, group)
    dist.all_reduce(work, op=getattr(dist.ReduceOp, op.upper()), group=group)
    return _copy_back(t, work)


def all_done(done: bool) -> bool:
    """Whether every rank is done (each passes its own flag): ranks that generate in step."""
    flag = torch.tensor([0.0 if done else 1.0])
    all_reduce_(flag)
    return float(flag) == 0.0


def broadcast_(t: torch.Tensor, src: int = 0,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Overwrite ``t`` in place with rank ``src``'s values (``src`` is a global rank)."""
    if not is_initialized():
        return t
    work = _staged(t, group)
    dist.broadcast(work, src=src, group=group)
    return _copy_back(t, work)


def all_gather(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on every rank), in rank order, on ``t``'s
    device."""
    if not is_initialized():
        return [t]
    work = _staged(t, group)
    out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, work, group=group)
    return [o.to(t.device) for o in out]


def all_gather_autograd(t: torch.Tensor, dim: int = 0,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``t`` (same shape) concatenated along ``dim`` in rank order, differentiable:
    the backward reduce-scatters (sums) the gradient, so each rank gets the gradient of its own
    part from every rank's use of the whole (context-parallel keys and values). torch's
    functional collective, so ``torch.compile`` traces it; on ``t``'s device."""
    if not is_initialized():
        return t
    from torch.distributed import _functional_collectives as funcol

    work = t.to(group_device(group)).movedim(dim, 0).contiguous()  # gathers along dim 0
    out = funcol.all_gather_single(work, 0, group)  # (n * t.shape[dim], ...)
    return out.movedim(0, dim).to(t.device)


def reduce_scatter_(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``input`` (group size x ``output``'s elements) over ``group`` and keep this rank's
    slice in ``output`` (the collective FSDP2 reduces gradients with)."""
    if op not in ("sum", "max", "min"):
        raise ValueError(f"reduce_scatter_: op {op!r} is not one of sum, max, min")
    if not is_initialized():
        return _copy_back(output, input.reshape(output.shape))
    work_out, work_in = _staged(output, group), _staged(input, group)
    # torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective(work_out, work_in, op=getattr(dist.ReduceOp, op.upper()), group=group)
    return _copy_back(output, work_out)


def all_to_all_single_(
    output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
    input_split_sizes: list[int], group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``dist.all_to_all_single`` on the group's device; fills ``output`` in place."""
    if not is_initialized():
        return _copy_back(output, input)
    work_out, work_in = _staged(output, group), _staged(input, group)
    dist.all_to_all_single(work_out, work_in, output_split_sizes, input_split_sizes,
                           group=group)
    return _copy_back(output, work_out)


def send_(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``t`` to global rank ``dst`` (blocking; pairs with ``recv_`` there)."""
    if not is_initialized():
        raise RuntimeError("send_: no process group (point-to-point needs two processes)")
    dist.send(_staged(t, group), dst=dst, group=group)


def recv_(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive into ``t`` (its shape and dtype) from global rank ``src``."""
    if not is_initialized():
        raise RuntimeError("recv_: no process group (point-to-point needs two processes)")
    work = _staged(t, group)
    dist.recv(work, src=src, group=group)
    return _copy_back(t, work)


def broadcast_object(obj, src: int = 0, group: dist.ProcessGroup | None = None):
    """Rank ``src``'s picklable ``obj`` on every rank (kiln's own values only: it unpickles)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=group_device(group))
    return box[0]


def all_gather_object(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order (kiln's own values only: it unpickles)."""
    if not is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 / TP shard), without importing DTensor: an object of
    a class from a module nobody imported cannot exist, and single-process runs skip importing
    torch.distributed.tensor (about 1 s on a small CPU; time to first step)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t
