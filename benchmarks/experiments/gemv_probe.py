"""The batch-1 products of a decode step, each on its own: how much of the memory bandwidth
cuBLAS, Inductor's coordinate-descent reduction and a Triton matrix-vector kernel reach.

At batch 1 a decode step's products read each weight once for one row of activations, so their
speed is the bandwidth they reach. ``decode_profile.py`` shows cuBLAS reaching about a third of
it on the 1.1 B Llama shape's q/k/v and o products. This probe times, for each product shape of
that model (the fused q/k/v and gate/up, o, down, the vocabulary head), in bf16:

  cublas        ``F.linear(x, w)``, as the Decoder's fused-projection operator runs it
  cublas-mv     ``torch.mv(w, x[0])``: the same product as a matrix-vector call, which cuBLAS
                serves with its gemv kernels instead of a matrix-matrix tile
  inductor-cd   ``torch.compile`` of the same with ``coordinate_descent_tuning``: Inductor turns
                a one-row product into a reduction and tunes its blocks
  triton        the library's matrix-vector kernel (``decoding/matvec.py``: one program per
                block of output rows, looping over the inputs), autotuned over its block
                sizes, launched as any kernel (the library's launch with ``CUDAGRAPHS_PDL=0``)
  triton-pdl    the library's kernel and blocks, each call launched with programmatic
                dependent launch, as the library launches it on Hopper and later GPUs:
                scheduled while the call before it finishes, waiting for it before any load
  triton-wide   the same kernel (``matvec.one_row_kernel``), autotuned over a wider space:
                fewer rows per program (more programs for the small products) and longer input
                blocks (a whole row of 2048 inputs in one load); the chosen configuration is
                printed

and the down projection of a gated MLP from the fused gate/up product ``[gate, up]``: ``cublas``
is Inductor's one kernel for SiLU(gate) * up and then ``F.linear``, as a compiled step runs it;
``triton`` is ``gated_matvec``'s kernel, the activation computed as the kernel reads its
inputs, and ``triton-wide`` the same over the wider space.

Each is captured in a CUDA graph of 20 calls and replayed, so launch gaps are as in a decode
graph; µs per call is the median of 7 replays. GB/s counts the weight's bytes once per call.
The calls cycle through copies of the weight that together exceed four times the GPU's L2
cache: in a decode step the other layers' weights pass through L2 between two reads of one
weight, so a weight read again from L2 would flatter every way (an H200's 50 MB L2 holds the
q/k/v, o and down weights whole).

    python benchmarks/gemv_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

#: (name, output features N, input features K) of the 1.1 B Llama shape's products
SHAPES = (
    ("q/k/v fused", 2560, 2048),
    ("o", 2048, 2048),
    ("gate/up fused", 11264, 2048),
    ("down", 2048, 5632),
    ("vocabulary head", 32000, 2048),
)
#: (rows, inputs) per program that ``triton-wide`` tunes over: fewer rows than the library's for
#: more programs on the small products, and up to a whole row of 2048 inputs in one load.
WIDE_BLOCKS = (
    (2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 256), (8, 512), (8, 1024),
    (16, 256), (16, 512), (32, 256),
)  # fmt: skip
#: The down projection fed by the fused gate/up product: SiLU(gate) * up, then the product.
GATED_DOWN = ("down of SiLU(gate) * up", 2048, 5632)


def graphed_us(fn: Callable[[], Any], calls: int = 20, repeats: int = 7) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (median of repeats)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def cycling(
    product: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]
) -> Callable[[], Any]:
    """``product`` on the next weight at each call: a capture of 20 calls records them in turn."""
    turn = iter(range(1 << 62))
    return lambda: product(weights[next(turn) % len(weights)])


def wide_matvec(
    blocks: tuple[tuple[int, int], ...] = WIDE_BLOCKS, dependent: bool = False
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``F.linear(x, w)`` of one bf16 row by the library's kernel (``matvec.one_row_kernel``),
    tuned over ``blocks``, or ``gated_matvec``'s product where ``x`` is ``[gate, up]``, twice
    the weight's inputs wide; ``dependent``: launched with programmatic dependent launch. The
    returned function's ``tuned`` is Triton's autotuner."""
    import triton

    from cudagraphs.decoding.matvec import one_row_kernel, tune

    tuned = tune(one_row_kernel(), blocks)
    extra = {"launch_pdl": True} if dependent else {}

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        gated = x.shape[-1] == 2 * k  # [gate, up]: the gated down product
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        tuned[grid](x, w, out, n, k, gated, dependent, **extra)
        return out

    product.tuned = tuned  # type: ignore[attr-defined]
    return product


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the rows here (rewritten after each row)")
    parser.add_argument(
        "--ways", default="cublas,cublas-mv,inductor-cd,triton,triton-pdl,triton-wide",
        help="comma-separated ways to time (cublas is always timed: the reference)",
    )  # fmt: skip
    args = parser.parse_args()
    chosen = {"cublas", *args.ways.split(",")}
    if not torch.cuda.is_available():
        raise SystemExit("gemv_probe.py needs a CUDA GPU")
    from cudagraphs.decoding.matvec import BLOCKS

    torch.manual_seed(0)
    compiled = torch.compile(
        lambda x, w: F.linear(x, w), options={"coordinate_descent_tuning": True}, dynamic=False
    )
    activation = torch.compile(
        lambda gu: F.silu(gu[..., : gu.shape[-1] // 2]) * gu[..., gu.shape[-1] // 2 :]
    )
    wide = wide_matvec()
    plain = wide_matvec(BLOCKS)  # the library's kernel and blocks, without PDL
    dependent = wide_matvec(BLOCKS, dependent=True)  # the same, with PDL
    rows = []
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, one input row, "
          f"weights cycled past {l2_bytes / 2**20:.0f} MiB of L2")  # fmt: skip
    print("| product | N x K | way | µs per call | GB/s | max error vs cublas |")
    print("|---|---|---|---|---|---|")
    for name, n, k in (*SHAPES[:4], GATED_DOWN, SHAPES[4]):  # the head, least telling, last
        gated = name == GATED_DOWN[0]
        copies = -(-4 * l2_bytes // (n * k * 2))  # ceiling: past the L2 cache
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5]
        weights += [torch.randn_like(weights[0]) / k**0.5 for _ in range(copies - 1)]
        w = weights[0]
        x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
        ways = {
            "cublas": lambda w, x=x: F.linear(x, w),
            "cublas-mv": lambda w, x=x: torch.mv(w, x[0]).unsqueeze(0),
            "inductor-cd": lambda w, x=x: compiled(x, w),
            "triton": lambda w, x=x: plain(x, w),
            "triton-wide": lambda w, x=x: wide(x, w),
            "triton-pdl": lambda w, x=x: dependent(x, w),
        }
        if gated:
            ways = {
                "cublas": lambda w, x=x: F.linear(activation(x), w),
                "triton": lambda w, x=x: plain(x, w),
                "triton-wide": lambda w, x=x: wide(x, w),
                "triton-pdl": lambda w, x=x: dependent(x, w),
            }
        ways = {way: product for way, product in ways.items() if way in chosen}
        expected = ways["cublas"](w).float()
        for way, product in ways.items():
            error = (product(w).float() - expected).abs().max().item()
            us = graphed_us(cycling(product, weights))
            gbs = n * k * 2 / (us * 1e-6) / 1e9
            rows.append({"product": name, "n": n, "k": k, "way": way, "us": us, "gb_per_s": gbs,
                         "max_error": error})  # fmt: skip
            print(
                f"| {name} | {n} x {k} | {way} | {us:.2f} | {gbs:.0f} | {error:.2e} |", flush=True
            )
            if way == "triton-wide":
                rows[-1]["config"] = str(wide.tuned.best_config)  # type: ignore[attr-defined]
                print(f"  chosen: {rows[-1]['config']}", flush=True)
            if args.json:  # after each row: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "l2_bytes": l2_bytes, "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
