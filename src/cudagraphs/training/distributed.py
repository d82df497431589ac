"""Data-parallel training steps in graphs: DDP built where the capture happens.

PyTorch's requirements for a ``DistributedDataParallel`` model inside a CUDA graph: DDP is
constructed on the side stream the step is captured on, and at least 11 eager iterations run
before the capture. The first is the one users miss: DDP keeps a reference to each parameter's
``AccumulateGrad`` node, and a node runs its backward on the stream that was current when it was
made. Built on the default stream, the captured backward then synchronizes with the default
stream, the capture is invalidated, and under NCCL the other ranks wait forever.

Right::

    model = cg.ddp(MLP().cuda(), device_ids=[rank])     # DDP on cg.capture_stream()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    step = cg.train_step(step_fn, optimizer=opt)        # warms up 11 steps, then captures

Wrong: ``DDP(model)`` on the default stream and ``cg.train_step`` over it: refused before the
first step, with this fix (or pass ``stream=s`` to ``train_step`` when DDP was built under
``with torch.cuda.stream(s):`` yourself).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core import default_stream, modules_of
from ..errors import ConfigError, explain, require_cuda

__all__ = ["DDP_WARMUP", "capture_stream", "checked_sharding", "checked_warmup", "ddp"]

log = logging.getLogger("cudagraphs")

#: Eager DDP iterations PyTorch requires before a capture (its CUDA graphs notes).
DDP_WARMUP = 11
_BUILT_ON = "cudagraphs_capture_stream"  # set on a DDP model built by ddp(): the stream used


def capture_stream(device: torch.device | int | str | None = None) -> torch.cuda.Stream:
    """The side stream cudagraphs warms up and captures on for ``device`` (default: the current
    CUDA device); one per device, shared by every capture that is not given ``stream=``."""
    require_cuda("cg.capture_stream()")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return default_stream(
        torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    )


def ddp(module: nn.Module, **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, **ddp_kwargs)`` built on :func:`capture_stream`, so
    that ``cg.train_step`` can capture its backward and all-reduce. Needs an initialised
    process group and ``module`` on its CUDA device.

    ``gradient_as_bucket_view`` defaults to ``True`` here: the gradients then live in DDP's
    all-reduce buckets, which saves copying every gradient in and out of them on each step
    (``reports/gpu.md`` compares the two with a step captured by hand). Pass ``gradient_as_bucket_view=False`` for DDP's own
    default.

    Right::

        model = cg.ddp(model.cuda(rank), device_ids=[rank])
        step = cg.train_step(train_step, optimizer=opt)

    Wrong (DDP built on another stream; ``cg.train_step`` refuses it, naming this fix)::

        model = DistributedDataParallel(model.cuda(rank), device_ids=[rank])
    """
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    require_cuda("cg.ddp()")
    params = list(module.parameters())
    if not params or not params[0].is_cuda:
        raise ConfigError(
            explain(
                "cg.ddp needs a module with parameters on a CUDA device",
                "DDP is built on the CUDA stream the step will be captured on",
                "move the module first: cg.ddp(model.cuda(rank), device_ids=[rank])",
            )
        )
    stream = capture_stream(params[0].device)
    current = torch.cuda.current_stream(params[0].device)
    stream.wait_stream(current)  # the parameters' initialisation comes first
    with torch.cuda.stream(stream):
        wrapped = nn.parallel.DistributedDataParallel(module, **ddp_kwargs)
    current.wait_stream(stream)  # and the broadcast from rank 0 before anything after
    setattr(wrapped, _BUILT_ON, stream)
    return wrapped


def checked_warmup(
    fn: Callable[..., Any],
    modules: Sequence[nn.Module],
    *,
    warmup: int,
    warmup_given: bool,
    stream: torch.cuda.Stream | None,
) -> int:
    """The warm-up a training step over ``fn`` needs: ``warmup``, or at least
    :data:`DDP_WARMUP` when ``fn`` reaches a DDP model. Raises ``ConfigError`` when that DDP
    model was not built on the stream the step will be captured on, or ``warmup`` was given
    and is too small."""
    models = [
        m for m in modules_of(fn, modules) if isinstance(m, nn.parallel.DistributedDataParallel)
    ]
    if not models:
        return warmup
    for model in models:
        built_on = getattr(model, _BUILT_ON, None)
        if stream is not None:
            if built_on is not None and built_on.cuda_stream != stream.cuda_stream:
                raise ConfigError(
                    explain(
                        "the DDP model was built by cg.ddp on cg.capture_stream(), but the step "
                        "is captured on another stream (stream=...)",
                        "DDP's backward runs on the stream it was built on; a capture on "
                        "another one is invalidated",
                        "drop stream=..., or build DDP under that stream yourself",
                    )
                )
            continue  # the caller built DDP on the stream they pass: their word
        if built_on is None:
            raise ConfigError(
                explain(
                    "the training step uses a DistributedDataParallel model that was not built "
                    "on the stream the step is captured on",
                    "DDP keeps each parameter's AccumulateGrad node, which runs on the stream "
                    "that was current when DDP was built; a captured backward then waits on the "
                    "default stream, the capture is invalidated and the other ranks hang",
                    "build it with model = cg.ddp(module, device_ids=[rank]); or build it under "
                    "`with torch.cuda.stream(s):` and pass stream=s to cg.train_step",
                )
            )
    if warmup >= DDP_WARMUP:
        return warmup
    if warmup_given:
        raise ConfigError(
            explain(
                f"warmup={warmup} for a step over a DistributedDataParallel model",
                f"PyTorch requires at least {DDP_WARMUP} eager DDP iterations before a capture "
                "(DDP finishes setting up its buckets and hooks over the first ones)",
                f"pass warmup={DDP_WARMUP} or more, or leave warmup out",
            )
        )
    log.info("cudagraphs: DDP model in the step: %d eager steps before the capture", DDP_WARMUP)
    return DDP_WARMUP


def checked_sharding(fn: Callable[..., Any], modules: Sequence[nn.Module]) -> None:
    """Refuses a step over a model sharded with FSDP2 (``fully_shard``) whose shards live on
    the host (``offload_policy=CPUOffloadPolicy()``): its optimizer step and the copies to and
    from the host run outside the device, where a graph cannot record them."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 module exists
    if fsdp is None:
        return
    for root in modules_of(fn, modules):
        for name, module in root.named_modules():
            if not isinstance(module, fsdp.FSDPModule):
                continue
            on_host = [
                p for p in module.parameters(recurse=False)
                if p.device.type == "cpu" and getattr(p, "device_mesh", None) is not None
                and p.device_mesh.device_type != "cpu"
            ]  # fmt: skip
            if on_host:
                label = f"{type(root).__name__}{'.' + name if name else ''}"
                raise ConfigError(
                    explain(
                        f"{label} is sharded with fully_shard(..., offload_policy="
                        "CPUOffloadPolicy()): its parameters live on the host",
                        "a CUDA graph records device work only; the offloaded optimizer step "
                        "and the copies between host and device would run once, at capture",
                        "drop offload_policy (the shards then stay on the GPU), or train "
                        "this model without cg.train_step",
                    )
                )
