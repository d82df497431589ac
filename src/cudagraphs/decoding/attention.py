"""One decode token's attention over a static cache as one Triton kernel.

At batch 1 with a short cache, a decode token's attention reads a few hundred kilobytes per
layer, yet SDPA's path costs several kernels per layer: the mask turned into the form the
attention kernel takes, a memset, and the attention kernel itself after a long start
(``benchmarks/decode_profile.py`` lists them per token). :func:`decode_attention` is that
attention in one kernel, for the one case the Decoder's graphs replay every token:

* one query token per batch row, grouped key/value heads (each key/value head read once for
  its group of query heads, no ``repeat_kv`` copy);
* the cache as transformers' static cache holds it, ``[batch, kv_heads, positions, head size]``,
  read in place through its strides;
* transformers' boolean mask (True: attend), ``[batch, 1, 1, positions]``, or none.

One program per (batch row, key/value head) walks the cache positions in blocks with the
running-maximum softmax, sums in float32; float32 inputs use full-precision products (no
TF32). A row whose mask allows nothing gives zeros, as SDPA's math path does.

It is used only where :func:`applies`; anything else is left to SDPA. Its first call for a
shape compiles the kernel: make that call before a capture, as a graph's warm-up does.

Right::

    if applies(query, key, value, mask):
        out = decode_attention(query, key, value, mask, scale)   # [batch, heads, 1, head size]

Wrong::

    decode_attention(prefill_query, key, value, mask, scale)   # ValueError: one token only
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from .matvec import pdl

__all__ = ["MAX_POSITIONS", "applies", "computed_once", "decode_attention", "fits"]

#: The longest cache the kernel takes: one program per key/value head walks every position, so
#: a long cache with few heads is better served by SDPA's split kernels
#: (``benchmarks/experiments/attention_probe.py`` times both).
MAX_POSITIONS = 256
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Decided at import: a check under torch.compile must not import Triton (Dynamo would trace it).
_TRITON = importlib.util.find_spec("triton") is not None


def applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    """Whether :func:`decode_attention` computes this call: the inputs it takes
    (:func:`fits`), on a CUDA device, and Triton."""
    return query.is_cuda and _TRITON and fits(query, key, value, mask)


def fits(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    """Whether these are inputs :func:`decode_attention` takes, wherever they are: one query
    token, grouped heads, head sizes of a power of two from 16 to 256, a cache of at most
    :data:`MAX_POSITIONS` positions, one device and dtype, a boolean mask shared by the heads
    (or none). Under ``torch.compile`` with a dynamic batch these are checks on its size, which
    hold for every batch of the trace."""
    batch, heads, tokens, size = query.shape
    kv_heads, positions = key.shape[1], key.shape[2]
    return (
        tokens == 1
        and query.dtype in _DTYPES
        and key.dtype == value.dtype == query.dtype
        and key.device == value.device == query.device
        and key.shape == value.shape
        and key.shape[0] == batch
        and key.shape[3] == size
        and heads % kv_heads == 0
        and 16 <= size <= 256
        and size & (size - 1) == 0
        and positions <= MAX_POSITIONS
        and (mask is None or _mask_fits(mask, batch, positions, query.device))
    )


def _mask_fits(mask: torch.Tensor, batch: int, positions: int, device: torch.device) -> bool:
    return (
        mask.dtype == torch.bool
        and mask.device == device
        and mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1] == 1
        and mask.shape[2] == 1
        and mask.shape[3] == positions
    )


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of one query token per row: ``query`` ``[batch, heads, 1, d]``,
    ``key`` and ``value`` ``[batch, kv_heads, positions, d]`` (the query heads of a key/value
    head consecutive, transformers' ``repeat_kv`` order), ``mask`` boolean ``[batch or 1, 1, 1,
    positions]`` or ``None``; ``scale`` defaults to ``d ** -0.5``. Returns ``[batch, heads, 1,
    d]``, like ``F.scaled_dot_product_attention(..., enable_gqa=True)``. Raises ``ValueError``
    where :func:`applies` is false."""
    if not applies(query, key, value, mask):
        raise ValueError(
            "decode_attention takes one query token per row, grouped heads whose size is a "
            f"power of two from 16 to 256, at most {MAX_POSITIONS} cache positions, one CUDA "
            f"device and dtype and a boolean mask [batch, 1, 1, positions]; got query "
            f"{tuple(query.shape)} {query.dtype} on {query.device}, key {tuple(key.shape)}, "
            f"mask {None if mask is None else (tuple(mask.shape), mask.dtype)}: use SDPA here"
        )
    return torch.ops.cudagraphs.decode_attention(
        query, key, value, mask, query.shape[-1] ** -0.5 if scale is None else float(scale)
    )


@torch.library.custom_op("cudagraphs::decode_attention", mutates_args=())
def _decode_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    batch, heads, _, size = query.shape
    kv_heads, positions = key.shape[1], key.shape[2]
    group = heads // kv_heads
    out = torch.empty(batch, heads, 1, size, device=query.device, dtype=query.dtype)
    has_mask = mask is not None
    mask_arg = mask if mask is not None else query  # any pointer: not read without a mask
    mask_strides = (
        (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(3)) if mask is not None else (0, 0)
    )
    # The whole cache in one block where it fits (one round of loads instead of a chain), up
    # to 32 KiB of keys per block so that a block's keys and values fit in shared memory.
    widest = max(16, (32 * 1024) // (size * query.element_size()))
    block = min(max(16, 1 << (positions - 1).bit_length()), MAX_POSITIONS, widest)
    dependent = pdl(query.device)  # programmatic dependent launch, as the one-row products
    _kernel()[(batch * kv_heads,)](
        query, key, value, mask_arg, out, positions, kv_heads, scale,
        query.stride(0), query.stride(1), query.stride(3),
        key.stride(0), key.stride(1), key.stride(2), key.stride(3),
        value.stride(0), value.stride(1), value.stride(2), value.stride(3),
        mask_strides[0], mask_strides[1],
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), HEAD_SIZE=size,
        BLOCK=block, HAS_MASK=has_mask, IEEE=query.dtype == torch.float32, PDL=dependent,
        num_warps=8 if block * size >= 128 * 64 else 4, num_stages=1, launch_pdl=dependent,
    )  # fmt: skip
    return out


@_decode_attention_op.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    return query.new_empty(query.shape)


@torch.library.custom_op("cudagraphs::computed_once", mutates_args=())
def computed_once(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` that Inductor cannot see into, so it computes ``tensor`` once for
    all its readers. Inductor recomputes a cheap pointwise result inside each kernel that reads
    it, and for each opaque operator (such as :func:`decode_attention`) in a kernel of its
    own: a mask that every layer reads then costs a kernel per layer."""
    return tensor.clone()


@computed_once.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, built on first use; ``None`` without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def attend(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, positions, kv_heads, scale,
        sq_b, sq_h, sq_d, sk_b, sk_h, sk_p, sk_d, sv_b, sv_h, sv_p, sv_d, sm_b, sm_p, so_b, so_h,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
        BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # before any load: the kernel before this one may still be writing q, k, v
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        row = pid // kv_heads
        kv_head = pid % kv_heads
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)  # this group's query heads
        real = tl.arange(0, GROUP_PAD) < GROUP
        dims = tl.arange(0, HEAD_SIZE)
        q = tl.load(
            q_ptr + row * sq_b + heads[:, None] * sq_h + dims[None, :] * sq_d,
            mask=real[:, None], other=0.0,
        )  # fmt: skip
        top = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_SIZE), dtype=tl.float32)
        k_base = k_ptr + row * sk_b + kv_head * sk_h
        v_base = v_ptr + row * sv_b + kv_head * sv_h
        for start in range(0, positions, BLOCK):
            spots = start + tl.arange(0, BLOCK)
            allowed = spots < positions
            if HAS_MASK:
                allowed &= tl.load(
                    mask_ptr + row * sm_b + spots * sm_p, mask=spots < positions, other=0
                ).to(tl.int1)
            # Only the allowed positions are read: a row attends to its own length of a
            # longer rung, and a position it does not attend to costs no memory traffic.
            k = tl.load(
                k_base + spots[:, None] * sk_p + dims[None, :] * sk_d,
                mask=allowed[:, None], other=0.0,
            )  # fmt: skip
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(allowed[None, :], scores * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            # Rows with nothing allowed yet keep -inf; their factors are taken as 0, not NaN.
            safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
            factor = tl.where(top == float("-inf"), 0.0, tl.exp(top - safe_top))
            weights = tl.where(allowed[None, :], tl.exp(scores - safe_top[:, None]), 0.0)
            total = total * factor + tl.sum(weights, axis=1)
            v = tl.load(
                v_base + spots[:, None] * sv_p + dims[None, :] * sv_d,
                mask=allowed[:, None], other=0.0,
            )  # fmt: skip
            if IEEE:
                acc = acc * factor[:, None] + tl.dot(weights, v, input_precision="ieee")
            else:
                acc = acc * factor[:, None] + tl.dot(weights.to(v.dtype), v)
            top = new_top
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # nothing allowed: zeros
        tl.store(
            out_ptr + row * so_b + heads[:, None] * so_h + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=real[:, None],
        )  # fmt: skip

    return attend
