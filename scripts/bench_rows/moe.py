"""One MoE layer's training step (router, dispatch, experts, combine; forward, backward, AdamW
step) on (batch, seq, dim) activations that need a gradient, as inside a model: kiln's ``moe``
feed-forward against torchtitan 0.2.2's ``MoE`` module at the same shape, expert count, top-k and
routing (softmax scores, gates renormalised over the k chosen and applied after the experts,
no shared expert, bias balancing on).

Each side uses its fastest expert kernel that runs on a CPU: kiln's ``dispatch = "auto"``
(``torch._grouped_mm``). torchtitan's grouped path builds its padded token permutation with a
Triton kernel (CUDA only), so the peer runs it with torchtitan's own CPU version of that
permutation (``generate_permute_indices(..., use_cpu=True)``); the peer times that and its
per-expert loop in one process and reports the faster (``kernel`` says which). torchtitan's
router counts tokens with ``torch.histc`` on int64 ids, which has no CPU kernel: the peer counts
a float copy (``_histc_on_integers``). kiln's side also moves the balancing bias every step
(``on_global_step``); torchtitan does that in an optimizer hook outside the module, which the
peer leaves out.
"""

from __future__ import annotations

import contextlib

from bench_rows.common import median_seconds, set_threads, torchtitan_missing

SHAPE = {"batch": 8, "seq": 256, "dim": 256, "experts": 8, "top_k": 2, "hidden": 256}


def _step_time(module, params, extra, p: dict) -> float:
    """Median seconds of one training step of ``module`` (``extra()`` after each step)."""
    import torch

    s = SHAPE
    x = torch.randn(s["batch"], s["seq"], s["dim"], generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if p["bf16"]
                else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            y = module(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        x.grad = None
        extra()

    for _ in range(p["warmup"]):
        step()
    return median_seconds(step, p["steps"])


def _result(seconds: float, params: int, **more) -> dict:
    tokens = SHAPE["batch"] * SHAPE["seq"]
    return {"tokens_per_second": tokens / seconds, "step_time_s": seconds, "params": params,
            **more}


def kiln(p: dict) -> dict:
    import torch

    from kiln.components.base import default_config
    from kiln.components.ffn.moe_dispatch import resolve_kernel

    set_threads(p["threads"])
    torch.manual_seed(0)
    s = SHAPE
    cfg = default_config("ffn", "moe", n_experts=s["experts"], top_k=s["top_k"],
                         hidden_dim=s["hidden"], score="softmax", renormalize=True)
    moe = cfg.build(dim=s["dim"], layer_idx=0, n_layers=1).train()
    dtype = torch.bfloat16 if p["bf16"] else torch.float32
    kernel = resolve_kernel(cfg.dispatch, torch.device("cpu"), dtype)
    seconds = _step_time(moe, list(moe.parameters()), lambda: moe.on_global_step(False), p)
    return _result(seconds, sum(x.numel() for x in moe.parameters()), kernel=kernel)


def peer(p: dict) -> dict:
    from importlib import metadata

    import torch

    try:
        from torchtitan.models.moe import moe as titan_moe
        from torchtitan.models.moe import utils as titan_utils
        from torchtitan.models.moe.kernels import generate_permute_indices
    except ImportError as exc:
        raise torchtitan_missing(exc) from None
    set_threads(p["threads"])
    _histc_on_integers(torch)
    torch.manual_seed(0)
    s = SHAPE
    # torchtitan's CPU implementation of its Triton permutation kernel, for the grouped path
    def permute_on_cpu(*args, **kwargs):
        return generate_permute_indices(*args, **kwargs, use_cpu=True)

    titan_utils.generate_permute_indices = permute_on_cpu
    kernels = ["grouped", "loop"] if p.get("peer_kernel", "fastest") == "fastest" else [
        p["peer_kernel"]]
    times = {}
    for kernel in kernels:
        torch.manual_seed(0)
        args = titan_moe.MoEArgs(
            num_experts=s["experts"], num_shared_experts=0, top_k=s["top_k"],
            score_func="softmax", route_norm=True, score_before_experts=False,
            use_grouped_mm=kernel == "grouped", load_balance_coeff=1e-3)
        moe = titan_moe.MoE(args, dim=s["dim"], hidden_dim=s["hidden"])
        with torch.no_grad():  # as torchtitan's trainer does
            moe.init_weights(0.02, torch.device("cpu"))
        moe.train()
        times[kernel] = _step_time(moe, list(moe.parameters()), lambda: None, p)
    best = min(times, key=times.get)
    return _result(times[best], sum(x.numel() for x in moe.parameters()), kernel=best,
                   version=f"torchtitan {metadata.version('torchtitan')}")

def _histc_on_integers(torch) -> None:
    """torchtitan's router counts tokens per expert with ``torch.histc`` on int64 expert ids,
    which has a CUDA kernel (counts in the input's dtype) but no CPU one ("histogram_cpu" not
    implemented for 'Long'); on the CPU the peer counts a float copy and returns int64 counts."""
    histc = torch.histc

    def counted(x, *args, **kwargs):
        if x.is_floating_point():
            return histc(x, *args, **kwargs)
        return histc(x.float(), *args, **kwargs).to(x.dtype)

    torch.histc = counted
