"""optimizer_state_bytes: plain, tensor-subclass (8-bit) and shared state tensors."""

from __future__ import annotations

import torch

from kiln.components.optimizers.memory import optimizer_state_bytes, tensor_bytes


def test_adamw_state_is_two_fp32_moments_plus_steps():
    p = torch.nn.Parameter(torch.zeros(10, 10))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(10, 10)
    opt.step()
    assert optimizer_state_bytes(opt) == 2 * 100 * 4 + 4  # exp_avg, exp_avg_sq, step (fp32)


def test_shared_tensors_count_once_and_subclasses_by_their_parts():
    class Q:  # an optimizer-like object whose two params share one lookup table
        shared = torch.zeros(256)
        state = {0: {"m": torch.zeros(8, dtype=torch.uint8), "qmap": shared},
                 1: {"m": torch.zeros(8, dtype=torch.uint8), "qmap": shared}}

    assert optimizer_state_bytes(Q()) == 8 + 8 + 256 * 4
    from torchao.optim.subclass_8bit import OptimState8bit

    q = OptimState8bit.zeros((4096,), True, 256, "cpu")
    assert tensor_bytes(q) == 4096 + 16 * 4 + 256 * 4  # codes, per-block scales, the qmap
