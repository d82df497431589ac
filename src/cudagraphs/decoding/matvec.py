"""One-row products as a Triton matrix-vector kernel, for decoding at batch 1.

At batch 1 a decode step multiplies one row of activations by each weight: the product reads
the weight once and does little else, so its speed is the memory bandwidth it reaches. The
general matrix kernels a library picks for such shapes reach a fraction of it on small weights
(`benchmarks/experiments/gemv_probe.py` times them side by side). :func:`matvec` is a kernel for exactly
that case: one program per block of output rows, each looping over the inputs, the sums kept in
float32 per row and input column and added across columns once, after the loop.

It is used only where :func:`applies`: a CUDA tensor of one row, half or bfloat16, a contiguous
weight. Everything else (a batch of rows, float32, the CPU) is ``F.linear``. Under Triton's
interpreter (``TRITON_INTERPRET=1``), which runs kernels on the CPU, a CPU tensor counts too.

:func:`gated_matvec` is the MLP's down projection of a gated activation in one kernel:
``F.linear(F.silu(gate) * up, weight)`` from the fused gate/up product ``[gate, up]``, the
activation computed as the inputs are read (no kernel of its own), rounded as the model's own
modules round it.

Right::

    y = matvec(x, weight, bias) if applies(x, weight) else F.linear(x, weight, bias)

Wrong::

    y = matvec(x_batch_of_16, weight)   # ValueError: one row only; use F.linear

Its first call for a weight shape times a few block sizes (Triton's autotuner), which
synchronizes: make that first call before a capture, as a graph's warm-up does.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch.nn import functional as F

__all__ = [
    "BLOCKS",
    "PDL_VARIABLE",
    "applies",
    "applies_gated",
    "gated_matvec",
    "linear",
    "matvec",
    "one_row_kernel",
    "pdl",
    "pdl_requested",
    "tune",
]

_DTYPES = (torch.bfloat16, torch.float16)
# Decided at import, as Triton decides: its interpreter runs kernels on CPU tensors.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: On by default on Hopper and later GPUs, off with ``CUDAGRAPHS_PDL=0``: programmatic dependent
#: launch schedules the kernel while the kernel before it finishes; it waits
#: (``griddepcontrol.wait``) before reading or writing anything, so it never sees a half-written
#: input. The Decoder's compiled step asks Inductor for the same (``triton.enable_pdl``).
PDL_VARIABLE = "CUDAGRAPHS_PDL"


def applies(x: torch.Tensor, weight: torch.Tensor, inputs_per_column: int = 1) -> bool:
    """Whether :func:`matvec` computes ``F.linear(x, weight)`` here: one row of inputs on a CUDA
    device, half or bfloat16 like the weight, a contiguous two-dimensional weight, and Triton.
    ``inputs_per_column``: 2 for :func:`gated_matvec` (gate and up for each weight column)."""
    k = weight.shape[1] * inputs_per_column if weight.dim() == 2 else -1
    return (
        (x.is_cuda or _INTERPRETED)
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.is_contiguous()
        and x.shape[-1] == k
        and x.numel() == k
        and _kernel() is not None
    )


def applies_gated(gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gated_matvec` computes this product here (as :func:`applies`, with
    ``gate_up`` twice the weight's inputs wide)."""
    return applies(gate_up, weight, inputs_per_column=2)


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row ``x`` (any leading dims of size 1), summed in
    float32. Raises ``ValueError`` where :func:`applies` is false."""
    if not applies(x, weight):
        raise ValueError(
            f"matvec takes one row of half or bfloat16 inputs on a CUDA device and a contiguous "
            f"weight of the same dtype; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: use F.linear for this product"
        )
    return _launch(x, weight, bias, gated=False)


def gated_matvec(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight, bias)`` for one row ``gate_up = [gate, up]`` (the
    fused gate/up product), in one kernel; SiLU and the product rounded to the inputs' dtype as
    the model's modules round them, the sums kept in float32. Raises ``ValueError`` where
    :func:`applies_gated` is false.

    Right::

        down = gated_matvec(gate_up, mlp.down_proj.weight)      # gate_up: [1, 1, 2 * inner]

    Wrong::

        down = gated_matvec(F.silu(gate) * up, weight)   # ValueError: takes [gate, up]
    """
    if not applies_gated(gate_up, weight):
        raise ValueError(
            f"gated_matvec takes one contiguous row [gate, up] twice as wide as the weight's "
            f"inputs, half or bfloat16 on a CUDA device, and a contiguous weight of the same "
            f"dtype; got gate_up {tuple(gate_up.shape)} {gate_up.dtype} on {gate_up.device}, "
            f"weight {tuple(weight.shape)} {weight.dtype}: use "
            f"F.linear(F.silu(gate) * up, weight) for this product"
        )
    return _launch(gate_up, weight, bias, gated=True)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool
) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    _kernel()(x.reshape(-1), weight, out.reshape(n), n, k, gated, pdl(x.device))
    return out if bias is None else out + bias


#: (rows, inputs) per program that the library tunes over: 4 to 16 rows of a weight, 256 to
#: 1024 of its inputs a load, so each program keeps a few thousand float32 sums.
BLOCKS: tuple[tuple[int, int], ...] = ((4, 1024), (8, 512), (8, 1024), (16, 256), (16, 512))


@functools.cache
def one_row_kernel() -> Any:
    """The Triton kernel ``(x, weight, out, N, K, GATED, PDL, BLOCK_N, BLOCK_K)`` before any tuning
    (``None`` without Triton): one program per ``BLOCK_N`` rows of the weight, looping over
    ``BLOCK_K`` inputs at a time. Each program keeps a float32 sum per row and input column and
    adds across columns once, after the loop, so a step of the loop is loads and multiply-adds
    alone. ``GATED``: ``x`` is ``[gate, up]`` and the product's input is SiLU(gate) * up.
    ``PDL``: launched with programmatic dependent launch (``launch_pdl=True``), it waits for the
    kernel before it ahead of any load and lets the next one be scheduled at once.

    For tuning it over other block sizes (``benchmarks/experiments/gemv_probe.py`` does); :func:`matvec`
    and :func:`gated_matvec` are the tuned products.
    """
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def one_row_product(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, out_ptr, N, K,
        GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # before any load: the kernel before this one may still be writing x
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + cols
            w = tl.load(
                w_ptr + rows[:, None] * K + k[None, :],
                mask=(rows[:, None] < N) & (k[None, :] < K),
                other=0.0,
            )
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            if GATED:  # x is the gate; SiLU(gate) * up, each rounded as the model rounds it
                up = tl.load(x_ptr + K + k, mask=k < K, other=0.0)
                gate = x.to(tl.float32)
                act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
                x = (act * up.to(tl.float32)).to(up.dtype)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        total = tl.sum(acc, axis=1)
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=rows < N)

    return one_row_product


def tune(kernel: Any, blocks: tuple[tuple[int, int], ...]) -> Any:
    """``kernel`` under Triton's autotuner over ``blocks`` (rows, inputs), 4 or 8 warps and 2
    or 4 pipelined loads, keyed on the weight's shape; the timings kept in Triton's cache on
    disk where this Triton can (a second process does not time them again)."""
    import inspect

    import triton

    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k in blocks
        for w in (4, 8)
        for s in (2, 4)
    ]
    cached = "cache_results" in inspect.signature(triton.autotune).parameters
    keep = {"cache_results": True} if cached else {}
    return triton.autotune(configs=configs, key=["N", "K", "GATED"], **keep)(kernel)


@functools.cache
def _kernel() -> Any:
    """The launcher ``(x, weight, out, N, K, gated)``, built on first use; ``None`` without
    Triton."""
    kernel = one_row_kernel()
    if kernel is None:
        return None
    import triton

    if _INTERPRETED:  # the interpreter has no timer to tune with: one configuration
        one = {"BLOCK_N": 16, "BLOCK_K": 256}

        def launch(
            x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, n: int, k: int,
            gated: bool, dependent: bool,
        ) -> None:  # fmt: skip
            kernel[(triton.cdiv(n, one["BLOCK_N"]),)](x, weight, out, n, k, gated, False, **one)

        return launch

    tuned = tune(kernel, BLOCKS)

    def launch(
        x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, n: int, k: int, gated: bool,
        dependent: bool,
    ) -> None:  # fmt: skip
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        tuned[grid](x, weight, out, n, k, gated, dependent, launch_pdl=dependent)

    return launch


@functools.cache
def pdl_requested() -> bool:
    """Whether programmatic dependent launch is wanted: unless ``CUDAGRAPHS_PDL=0`` (read on
    first use), and never under Triton's interpreter. Where the GPU cannot do it, Triton and
    Inductor launch as usual: :func:`pdl` asks the device."""
    return os.environ.get(PDL_VARIABLE, "1") != "0" and not _INTERPRETED


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether the kernel runs with programmatic dependent launch on ``device``: wanted
    (:func:`pdl_requested`), on a CUDA GPU of compute capability 9 (Hopper) or later."""
    return (
        pdl_requested()
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`matvec` where it applies, else ``F.linear``."""
    return matvec(x, weight, bias) if applies(x, weight) else F.linear(x, weight, bias)
