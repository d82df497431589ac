"""One decode token's attention over a static cache, per layer, three ways: is a kernel that
reads each key/value head once for its group of query heads worth its keep?

At batch 1 the Decoder's attention (transformers' SDPA path over a static cache with a mask)
runs cuDNN's attention and, around it, kernels that expand the grouped key/value heads over the
whole cache (``repeat_kv``) and build the mask: ``decode_profile.py`` counts those as a third of
the attention's time per layer. This probe times, in bf16 on the 1.1 B Llama shape (32 query
heads, 4 key/value heads, head size 64), one layer's attention for one new token:

  repeat_kv + sdpa   ``repeat_kv`` of the cache, then SDPA with a boolean mask of the valid
                     positions: what transformers' SDPA attention does with a mask
  sdpa gqa           SDPA with ``enable_gqa=True`` and the same mask: no copy of the cache
  grouped kernel     :func:`decode_attention` below: one Triton program per key/value head and
                     block of positions reads that head's keys and values once for its query
                     heads, skips the positions past the valid length (read from a device
                     tensor, so a graph replays it for any length), and the blocks' partial
                     results are merged in a second small kernel

Each way is captured in a CUDA graph of 22 calls (one per layer of the model, each on its own
layer's cache, as ``gemv_probe.py`` cycles through weights) and replayed; µs per layer is the
median of 7 replays over 22. The answers are
compared with a float32 reference first.

    python benchmarks/experiments/attention_probe.py [--lengths 168,1024,4096] [--rows 1,16]
                                                     [--mixed] [--json PATH]

The library's own two ways are timed too: its one-token kernel (called past its front door's
``MAX_POSITIONS``, to tell whether that cap should move for a wide batch) and the grouped
view over SDPA that runs past the cap. ``--mixed``: rows at their own lengths, as an
engine's rows are (the kernel reads only the positions a row attends to).

The kernel lives here, not in the library, until it has been measured to pay; its CPU test runs
it under Triton's interpreter (``tests/test_attention_probe.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from gemv_probe import cycling, graphed_us
from torch.nn import functional as F

HEADS, KV_HEADS, HEAD_SIZE, LAYERS = 32, 4, 64, 22


@triton.jit
def _partial_attention(
    q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, max_ptr, sum_ptr,
    positions, blocks, kv_heads, scale,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: one (batch row, key/value head) and one block of cache positions. Writes
    the block's unnormalized output for the head's GROUP query heads, with its running max and
    sum, for :func:`_merge` to combine."""
    row_head = tl.program_id(0)  # batch row * KV_HEADS + key/value head
    block = tl.program_id(1)
    groups = tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_SIZE)
    spots = block * BLOCK + tl.arange(0, BLOCK)
    # q: [rows * kv_heads, GROUP, HEAD_SIZE]; k, v: [rows * kv_heads, positions, HEAD_SIZE]
    q = tl.load(q_ptr + row_head * GROUP * HEAD_SIZE + groups[:, None] * HEAD_SIZE + dims[None, :])
    valid = tl.load(valid_ptr + row_head // kv_heads)
    inside = (spots < valid) & (spots < positions)
    base = row_head * positions * HEAD_SIZE
    k = tl.load(
        k_ptr + base + spots[:, None] * HEAD_SIZE + dims[None, :], mask=inside[:, None], other=0.0
    )
    v = tl.load(
        v_ptr + base + spots[:, None] * HEAD_SIZE + dims[None, :], mask=inside[:, None], other=0.0
    )
    scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
    scores = tl.where(inside[None, :], scores, float("-inf"))
    top = tl.max(scores, axis=1)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(scores - top_safe[:, None])
    weights = tl.where(inside[None, :], weights, 0.0)
    total = tl.sum(weights, axis=1)
    out = tl.sum(weights[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    at = (row_head * blocks + block) * GROUP + groups
    tl.store(out_ptr + at[:, None] * HEAD_SIZE + dims[None, :], out)
    tl.store(max_ptr + at, top)
    tl.store(sum_ptr + at, total)


@triton.jit
def _merge(
    out_ptr, max_ptr, sum_ptr, result_ptr, blocks,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """One program per (batch row, key/value head): the blocks' partial results combined with
    their maxima (the log-sum-exp merge of split attention), normalized, stored per query head."""
    row_head = tl.program_id(0)
    groups = tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_SIZE)
    parts = tl.arange(0, BLOCKS)
    used = parts < blocks
    at = (row_head * blocks + parts[:, None]) * GROUP + groups[None, :]  # [BLOCKS, GROUP]
    tops = tl.load(max_ptr + at, mask=used[:, None], other=float("-inf"))
    sums = tl.load(sum_ptr + at, mask=used[:, None], other=0.0)
    top = tl.max(tops, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    factor = tl.where(tops == float("-inf"), 0.0, tl.exp(tops - top_safe[None, :]))
    outs = tl.load(
        out_ptr + at[:, :, None] * HEAD_SIZE + dims[None, None, :],
        mask=used[:, None, None], other=0.0,
    )  # fmt: skip
    merged = tl.sum(outs * factor[:, :, None], axis=0)
    total = tl.sum(sums * factor, axis=0)
    merged = merged / tl.where(total == 0.0, 1.0, total)[:, None]
    where = (row_head * GROUP + groups)[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(result_ptr + where, merged.to(result_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, block: int = 64
) -> torch.Tensor:
    """Attention of one new token per batch row over a static cache, grouped heads read once.

    ``q``: [rows, heads, 1, head size]; ``k``, ``v``: [rows, key/value heads, positions, head
    size], contiguous; ``valid``: int32 [rows], how many cache positions each row has filled
    (the rest are skipped). Returns [rows, heads, 1, head size] in ``q``'s dtype. The query
    heads of a key/value head are consecutive (transformers' ``repeat_kv`` order).
    """
    rows, heads, one, size = q.shape
    kv_heads, positions = k.shape[1], k.shape[2]
    if (
        one != 1
        or heads % kv_heads
        or not (k.is_contiguous() and v.is_contiguous())
        or (valid.dtype != torch.int32)
    ):
        raise ValueError(
            f"decode_attention takes one query token, contiguous caches whose head count "
            f"divides the query's and int32 lengths; got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, valid {valid.dtype}"
        )
    group = heads // kv_heads
    blocks = triton.cdiv(positions, block)
    partial = torch.empty(
        rows * kv_heads * blocks * group, size, device=q.device, dtype=torch.float32
    )
    tops = torch.empty(rows * kv_heads * blocks * group, device=q.device, dtype=torch.float32)
    sums = torch.empty_like(tops)
    queries = q.reshape(rows * kv_heads, group, size).contiguous()
    _partial_attention[(rows * kv_heads, blocks)](
        queries, k, v, valid, partial, tops, sums, positions, blocks, kv_heads, size**-0.5,
        GROUP=group, HEAD_SIZE=size, BLOCK=block,
    )  # fmt: skip
    result = torch.empty(rows * heads, size, device=q.device, dtype=q.dtype)
    _merge[(rows * kv_heads,)](
        partial, tops, sums, result, blocks,
        GROUP=group, HEAD_SIZE=size, BLOCKS=triton.next_power_of_2(blocks),
    )  # fmt: skip
    return result.reshape(rows, heads, 1, size)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The same attention in float32 through ``repeat_kv`` and a masked SDPA."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    mask = torch.arange(k.shape[2], device=k.device)[None, :] < valid[:, None]
    return F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask[:, None, None, :])


def _ways(valid: torch.Tensor) -> dict[str, Callable[..., torch.Tensor]]:
    def repeat_kv_sdpa(q: Any, k: Any, v: Any) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        keys = (
            k[:, :, None]
            .expand(-1, -1, group, -1, -1)
            .reshape(q.shape[0], q.shape[1], *k.shape[2:])
        )
        values = (
            v[:, :, None]
            .expand(-1, -1, group, -1, -1)
            .reshape(q.shape[0], q.shape[1], *v.shape[2:])
        )
        mask = torch.arange(k.shape[2], device=k.device)[None, :] < valid[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :])

    def sdpa_gqa(q: Any, k: Any, v: Any) -> torch.Tensor:
        mask = torch.arange(k.shape[2], device=k.device)[None, :] < valid[:, None]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], enable_gqa=True
        )

    def one_kernel(q: Any, k: Any, v: Any) -> torch.Tensor:
        # The library's operator itself: its front door takes at most MAX_POSITIONS
        # positions, which is what this row tells whether to lift.
        import cudagraphs.decoding.attention  # noqa: F401  (registers the operator)

        mask = torch.arange(k.shape[2], device=k.device)[None, :] < valid[:, None]
        return torch.ops.cudagraphs.decode_attention(
            q, k, v, mask[:, None, None, :], q.shape[-1] ** -0.5
        )

    def grouped_view_sdpa(q: Any, k: Any, v: Any) -> torch.Tensor:
        # What the Decoder and the engine run past MAX_POSITIONS: the group's query heads as
        # one key/value head's queries, SDPA on the cache as it is.
        from cudagraphs.decoding.grouped_attention import grouped_sdpa_attention

        mask = torch.arange(k.shape[2], device=k.device)[None, :] < valid[:, None]
        out, _ = grouped_sdpa_attention(None, q, k, v, mask[:, None, None, :])
        return out.transpose(1, 2)

    return {
        "repeat_kv + sdpa": repeat_kv_sdpa,
        "sdpa gqa": sdpa_gqa,
        "grouped kernel": lambda q, k, v: decode_attention(q, k, v, valid),
        "one-kernel decode attention (library)": one_kernel,
        "grouped view + sdpa (library, past MAX_POSITIONS)": grouped_view_sdpa,
    }


def probe(length: int, rows: int = 1, mixed: bool = False) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    caches = [
        (torch.randn(rows, KV_HEADS, length, HEAD_SIZE, device=device, dtype=dtype),
         torch.randn(rows, KV_HEADS, length, HEAD_SIZE, device=device, dtype=dtype))
        for _ in range(LAYERS)
    ]  # fmt: skip
    q = torch.randn(rows, HEADS, 1, HEAD_SIZE, device=device, dtype=dtype)
    valid = torch.full((rows,), length - 7, device=device, dtype=torch.int32)
    if mixed:  # rows at their own lengths, from an eighth of the cache to all but 7
        valid = torch.linspace(length // 8, length - 7, rows, device=device).to(torch.int32)
    expected = reference(q, *caches[0], valid)
    results = []
    for name, way in _ways(valid).items():
        error = (way(q, *caches[0]).float() - expected).abs().max().item()
        layers = [functools.partial(way, q, *cache) for cache in caches]
        us = graphed_us(cycling(lambda layer: layer(), layers), calls=LAYERS)
        results.append({"way": name, "length": length, "rows": rows, "mixed": mixed,
                        "us_per_layer": us, "max_error": error})  # fmt: skip
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="168,1024,4096")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument(
        "--mixed", action="store_true",
        help="rows at their own lengths (an eighth of the cache to all of it), as an engine's",
    )  # fmt: skip
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    results = []
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; one layer's attention "
        f"for one new token ({HEADS} query heads, {KV_HEADS} key/value heads, head size "
        f"{HEAD_SIZE}), {LAYERS} layers in one CUDA graph, median of 7 replays; "
        + (
            "each row's cache filled from an eighth of it to all but its last 7 positions."
            if args.mixed
            else "the cache filled but for its last 7 positions."
        ),
        "",
        "| cache length | batch | way | µs per layer | max error against float32 |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            for row in probe(length, rows, args.mixed):
                results.append(row)
                lines.append(
                    f"| {length} | {rows} | {row['way']} | {row['us_per_layer']:.2f} | "
                    f"{row['max_error']:.1e} |"
                )
                print(lines[-1], flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": results}, handle, indent=2)  # fmt: skip
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
