"""A decoder layer's products at batch 1 with their neighbours folded in: do fewer, fuller
kernels pay, before any of it is wired into the Decoder?

At batch 1 a Llama layer's non-attention work is four products and the small kernels around
them: the two RMS norms, the residual adds and the SiLU gate. ``decode_profile.py`` counts
about sixteen kernels per layer in the Decoder's graph. Each product reads one weight once, so
its floor is the weight's bytes at the memory bandwidth, and each kernel boundary costs a few
microseconds of ramp and tail that the bytes do not explain (``gemv_probe.py``). This probe
folds every neighbour into a product, four kernels per layer:

  norm_matvec          rms_norm(x) * g, then its product by the fused q/k/v (or gate/up) weight
  matvec_add           residual + the product (o, whose input is the attention's output)
  act_mul_matvec_add   residual + the product of act(gate) * up (down)

Each is one Triton program per block of output rows, looping over the inputs, sums in float32;
the norm's statistic is summed again by every program (the input row is a few kilobytes); the
input size is a compile-time constant (one kernel per weight shape). The
roundings follow transformers' modules (the normed row rounded to the dtype before the norm
weight, the gate rounded after the activation, the product rounded before the residual add).

Ways timed, each over 22 layers of the 1.1 B Llama shape in one CUDA graph, µs per layer the
median of 7 replays, the weights of every layer distinct (so nothing is read from L2 again):

  compiled     the same chain written in torch ops, ``torch.compile``'d (Inductor fuses the
               norms and adds; the products are cuBLAS's): what the Decoder runs today
  folded       the three kernels above, at a few block sizes
  folded+pdl   the same, each launched with programmatic dependent launch (Hopper): the next
               kernel is launched while this one runs and waits for its results on the device

The attention between the q/k/v and o products is not part of the chain (its output is stood
for by the first rows of the q/k/v product): ``attention_probe.py`` times it.

    python benchmarks/layer_kernels_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared helpers
from common import memory_bandwidth
from gemv_probe import graphed_us
from torch.nn import functional as F

#: The 1.1 B Llama shape: hidden size, MLP size, q/k/v rows, layers.
HIDDEN, MLP, QKV, LAYERS = 2048, 5632, 2560, 22
ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _act(g, ACT: tl.constexpr):  # type: ignore[no-untyped-def]
    if ACT == "silu":
        return g / (1.0 + tl.exp(-g))
    # tanh-approximated GELU (Gemma's MLP): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))


@triton.jit
def _start(BLOCK_N: tl.constexpr, PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """This program's output rows; with ``PDL`` the next kernel may launch now, and this one
    waits here for the previous kernel's results."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    return tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _block_products(w_ptr, rows, k, a, N, K):  # type: ignore[no-untyped-def]
    """The weight's ``rows`` x ``k`` block times the inputs ``a`` (float32), summed per row."""
    w = tl.load(
        w_ptr + rows[:, None] * K + k[None, :],
        mask=(rows[:, None] < N) & (k[None, :] < K),
        other=0.0,
    )
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1)


@triton.jit
def _norm_matvec(  # type: ignore[no-untyped-def]
    x_ptr, g_ptr, w_ptr, out_ptr, N, K: tl.constexpr, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PLUS_ONE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    rows = _start(BLOCK_N, PDL)
    cols = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        squares += x * x
    scale = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        if PLUS_ONE:  # Gemma's norm: x * (1 + g), in float32 before rounding
            a = (x * scale * (1.0 + g)).to(dtype).to(tl.float32)
        else:  # Llama's: the normed row rounded to the dtype, then times g, rounded again
            a = (g * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        acc += _block_products(w_ptr, rows, k, a, N, K)
    tl.store(out_ptr + rows, acc.to(dtype), mask=rows < N)


@triton.jit
def _matvec_add(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, res_ptr, out_ptr, N, K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    rows = _start(BLOCK_N, PDL)
    cols = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        if GATED:  # x holds gate then up, K each: a = act(gate) * up, each rounded
            gate = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + k, mask=k < K, other=0.0).to(tl.float32)
            a = _act(gate, ACT).to(dtype).to(tl.float32)
            a = (a * up).to(dtype).to(tl.float32)
        else:
            a = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += _block_products(w_ptr, rows, k, a, N, K)
    residual = tl.load(res_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) + residual).to(dtype)
    tl.store(out_ptr + rows, out, mask=rows < N)


def _check(x: torch.Tensor, weight: torch.Tensor, k: int, name: str) -> None:
    if x.numel() != k or not x.is_contiguous() or not weight.is_contiguous():
        raise ValueError(
            f"{name} takes one contiguous row of {k} inputs and a contiguous weight; got x "
            f"{tuple(x.shape)} (contiguous: {x.is_contiguous()}), weight {tuple(weight.shape)}"
        )


def _launch(
    kernel: Any, n: int, block_n: int, block_k: int, pdl: bool, *args: Any, **meta: Any
) -> None:
    extra = {"launch_pdl": True} if pdl else {}
    kernel[(triton.cdiv(n, block_n),)](
        *args, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=4, **meta, **extra
    )


def norm_matvec(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    plus_one: bool = False, block_n: int = 16, block_k: int = 256, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``F.linear(rms_norm(x) * norm_weight, weight)`` for one row ``x`` (``plus_one``: the
    norm multiplies by ``1 + norm_weight``, as Gemma's does)."""
    n, k = weight.shape
    _check(x, weight, k, "norm_matvec")
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    _launch(_norm_matvec, n, block_n, block_k, pdl, x, norm_weight, weight, out, n, k, eps,
            PLUS_ONE=plus_one)  # fmt: skip
    return out


def matvec_add(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
    block_n: int = 16, block_k: int = 256, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``residual + F.linear(x, weight)`` for one row ``x``."""
    n, k = weight.shape
    _check(x, weight, k, "matvec_add")
    out = torch.empty_like(residual)
    _launch(_matvec_add, n, block_n, block_k, pdl, x, weight, residual, out, n, k,
            GATED=False, ACT="silu")  # fmt: skip
    return out


def act_mul_matvec_add(
    gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, act: str = "silu",
    block_n: int = 16, block_k: int = 256, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``residual + F.linear(act(gate) * up, weight)``, ``gate_up`` one row of the gate's
    outputs then the up's (the fused gate/up product's layout)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}; got {act!r}")
    n, k = weight.shape
    _check(gate_up, weight, 2 * k, "act_mul_matvec_add")
    out = torch.empty_like(residual)
    _launch(_matvec_add, n, block_n, block_k, pdl, gate_up, weight, residual, out, n, k,
            GATED=True, ACT=act)  # fmt: skip
    return out


# The same arithmetic in torch ops, as transformers' modules write it: the reference of the
# tests and the chain Inductor compiles in the probe.


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (h * (1.0 + g.float())).to(x.dtype)
    return g * h.to(x.dtype)


def act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return F.silu if name == "silu" else (lambda t: F.gelu(t, approximate="tanh"))


def layer_chain(
    x: torch.Tensor, layers: list[dict[str, torch.Tensor]], eps: float, folded: bool,
    **launch: Any,
) -> torch.Tensor:  # fmt: skip
    """The layers' products with their neighbours (the attention stood for by the first
    ``HIDDEN`` q/k/v outputs), folded into the three kernels (``launch``: their block sizes
    and ``pdl``) or written in torch ops."""
    for w in layers:
        if folded:
            qkv = norm_matvec(x, w["g1"], eps, w["qkv"], **launch)
            h = matvec_add(qkv[..., : w["o"].shape[1]], w["o"], x, **launch)
            gate_up = norm_matvec(h, w["g2"], eps, w["gate_up"], **launch)
            x = act_mul_matvec_add(gate_up, w["down"], h, **launch)
        else:
            qkv = F.linear(rms_norm(x, w["g1"], eps), w["qkv"])
            h = x + F.linear(qkv[..., : w["o"].shape[1]].contiguous(), w["o"])
            gate, up = F.linear(rms_norm(h, w["g2"], eps), w["gate_up"]).chunk(2, dim=-1)
            x = h + F.linear(F.silu(gate) * up, w["down"])
    return x


def random_layers(
    count: int, device: str, dtype: torch.dtype, hidden: int = HIDDEN, mlp: int = MLP,
    qkv: int = QKV,
) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device) / shape[-1] ** 0.5).to(dtype)

    return [
        {"g1": 1 + 0.1 * w(hidden), "qkv": w(qkv, hidden), "o": w(hidden, hidden),
         "g2": 1 + 0.1 * w(hidden), "gate_up": w(2 * mlp, hidden), "down": w(hidden, mlp)}
        for _ in range(count)
    ]  # fmt: skip


#: The folded ways timed: name -> the kernels' launch settings.
FOLDED_WAYS: dict[str, dict[str, Any]] = {
    "folded, 8 rows a program": {"block_n": 8},
    "folded, 16 rows a program": {"block_n": 16},
    "folded, 32 rows a program": {"block_n": 32},
    "folded, 16 rows, inputs by 512": {"block_n": 16, "block_k": 512},
    "folded+pdl, 16 rows a program": {"block_n": 16, "pdl": True},
}


def probe(dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layers = random_layers(LAYERS, "cuda", dtype)
    eps = 1e-5
    x = torch.randn(1, HIDDEN, device="cuda", dtype=dtype)
    compiled = torch.compile(lambda t: layer_chain(t, layers, eps, folded=False))
    reference = compiled(x).float()
    weight_bytes = sum(t.numel() * t.element_size() for w in layers for t in w.values())
    ways: dict[str, Callable[[], torch.Tensor]] = {"compiled": lambda: compiled(x)}
    for name, launch in FOLDED_WAYS.items():
        ways[name] = lambda launch=launch: layer_chain(x, layers, eps, folded=True, **launch)
    rows: list[dict[str, Any]] = []
    for way, fn in ways.items():
        try:
            error = (fn().float() - reference).abs().max().item()
            us = graphed_us(fn, calls=1)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
        except Exception as failure:  # a Triton without programmatic dependent launch
            rows.append({"way": way, "failed": f"{type(failure).__name__}: {failure}"[:300]})
            continue
        kernels = sum(e.count for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
        rows.append({
            "way": way, "us_per_layer": us / LAYERS, "kernels_per_layer": kernels / LAYERS,
            "bandwidth_share": weight_bytes / (us * 1e-6) / memory_bandwidth(),
            "max_error_against_compiled": error,
        })  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = probe()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{LAYERS} layers of hidden {HIDDEN}, MLP {MLP}, bf16, batch 1")  # fmt: skip
    for row in rows:
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
