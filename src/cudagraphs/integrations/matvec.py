"""One-row products as a Triton matrix-vector kernel, for decoding at batch 1.

At batch 1 a decode step multiplies one row of activations by each weight: the product reads
the weight once and does little else, so its speed is the memory bandwidth it reaches. The
general matrix kernels a library picks for such shapes reach a fraction of it on small weights
(`benchmarks/gemv_probe.py` times them side by side). :func:`matvec` is a kernel for exactly
that case: one program per block of output rows, each looping over the inputs, the sums kept in
float32.

It is used only where :func:`applies`: a CUDA tensor of one row, half or bfloat16, a contiguous
weight. Everything else (a batch of rows, float32, the CPU) is ``F.linear``.

Right::

    y = matvec(x, weight, bias) if applies(x, weight) else F.linear(x, weight, bias)

Wrong::

    y = matvec(x_batch_of_16, weight)   # ValueError: one row only; use F.linear

Its first call for a weight shape times a few block sizes (Triton's autotuner), which
synchronizes: make that first call before a capture, as a graph's warm-up does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["applies", "linear", "matvec"]

_DTYPES = (torch.bfloat16, torch.float16)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`matvec` computes ``F.linear(x, weight)`` here: one row of inputs on a CUDA
    device, half or bfloat16 like the weight, a contiguous two-dimensional weight, and Triton."""
    return (
        x.is_cuda
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and x.numel() == weight.shape[1]
        and _kernel() is not None
    )


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row ``x`` (any leading dims of size 1), summed in
    float32. Raises ``ValueError`` where :func:`applies` is false."""
    if not applies(x, weight):
        raise ValueError(
            f"matvec takes one row of half or bfloat16 inputs on a CUDA device and a contiguous "
            f"weight of the same dtype; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: use F.linear for this product"
        )
    launch = _kernel()
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    launch(x.reshape(k), weight, out.reshape(n), n, k)
    return out if bias is None else out + bias


@functools.cache
def _kernel() -> Any:
    """The launcher ``(x, weight, out, N, K)``, built on first use; ``None`` without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
        for n in (8, 16, 32)
        for k in (256, 512)
        for w in (4, 8)
    ]

    @triton.autotune(configs=configs, key=["N", "K"])
    @triton.jit
    def kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + cols
            w = tl.load(
                w_ptr + rows[:, None] * K + k[None, :],
                mask=(rows[:, None] < N) & (k[None, :] < K),
                other=0.0,
            )
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < N)

    def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, n: int, k: int) -> None:
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, weight, out, n, k)

    return launch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`matvec` where it applies, else ``F.linear``."""
    return matvec(x, weight, bias) if applies(x, weight) else F.linear(x, weight, bias)
