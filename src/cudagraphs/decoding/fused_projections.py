"""Fused projections that stay the user's weights: q, k and v (and gate and up) as one product
over one buffer, with the model's parameters as views into it.

Decoding one token is a chain of small products. A Llama layer projects the same hidden state
three times (q, k, v) and, in its MLP, twice more (gate, up): five kernel launches, each too
small to keep the GPU busy. Reading the three (or two) weights as one matrix makes one larger
product out of them.

:func:`fuse_projections` does that in place, per layer:

* the weights (and biases) of a group are copied into one buffer, and each parameter is pointed
  at its rows (``param.data = buffer[rows]``): the **same parameter objects**, now views of one
  buffer. ``load_state_dict``, an optimizer step, an RL weight sync, anything that writes a
  parameter in place, writes the buffer, and the next product reads it. Nothing is baked in as a
  constant (no Inductor ``freezing``);
* each projection module's class becomes a subclass of its own (:class:`FusedLinear`, still an
  ``nn.Linear``), whose forward asks its group for the fused product: the first projection of a
  group called on a hidden state computes all of the group's outputs with one product and hands
  the others theirs when they are called on the same tensor.

The product is one operator, ``cudagraphs::rows_linear``, whose inputs are the parameters
themselves. At run time it checks that they still lie back to back in one buffer and then
multiplies by that buffer once; otherwise (a parameter replaced, ``param.data = t``,
``model.to(dtype)``) it computes each product on its own. Under ``torch.compile`` the check
runs each call (the operator is opaque to Inductor); inside a CUDA graph it ran at capture, and
the guards that catch a replaced or moved parameter capture again, which runs it again. So a
replaced parameter is never read through the old buffer.

Right::

    report = fuse_projections(model)     # before capturing or compiling anything
    model.load_state_dict(other_weights) # in place: the next call reads the new weights

Wrong::

    g = cg.graph(model, x)
    fuse_projections(model)   # works (the guard sees the moved parameters and captures again),
                              # but the first capture was wasted: fuse first

Under autograd (gradients enabled and weights that require them) each projection is its own
product again: the operator has no backward, and training is not what it is for.

Each projection of a group is expected to be called once per forward on the same hidden
state, as transformers' attention and MLP layers do; a projection called on another tensor
computes its own rows afresh. Models whose layers already hold one projection per group (Phi-3's
``qkv_proj`` and ``gate_up_proj``) have nothing to fuse.

With ``matvec=True`` a product of one row runs the Triton kernel of ``decoding/matvec.py``,
and the output and down projections, which stay one product each, are routed through the same
operator for one row (their weights not copied): one launch each where cuBLAS may launch two.
An MLP of SiLU(gate) times up (Llama, Qwen, Mistral) gets a class of its own whose forward,
for one row, is the fused gate/up product and :func:`gated_linear`, the activation computed
inside the down product (``report.gated``). Other batches, and an MLP whose projections or
activation were changed since, run the model's own operations (``F.linear``, the class's own
forward), which a compiler sees into.

Where a layer does not match (a projection that is not a plain ``nn.Linear``, differing input
sizes, dtypes or devices, a bias on some but not all), that layer is left as it was, and the
report says why.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..options import check_bool
from .matvec import applies_gated, gated_matvec
from .matvec import linear as matvec_linear

__all__ = [
    "FusedLinear",
    "FusionReport",
    "fuse_projections",
    "gated_linear",
    "one_row",
    "rows_linear",
    "unfuse_projections",
]

#: The groups fused, by the names of the projections as transformers' decoder layers call them.
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: The projections that stay one product each, which ``matvec=True`` also sends to the one-row
#: kernel: one launch where cuBLAS may split a one-row product into a partial product and a
#: reduction (``benchmarks/decode_profile.py`` lists both for the down projection).
SINGLES: tuple[tuple[str, ...], ...] = (("o_proj",), ("down_proj",))


def _back_to_back(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose rows are ``tensors`` in order, where they are contiguous, of one
    dtype and device, and lie back to back in one storage; else ``None``."""
    first = tensors[0]
    offset = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or t.shape[1:] != first.shape[1:]
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *first.shape[1:])
    return first.as_strided(
        shape, torch.empty(shape, device="meta").stride(), first.storage_offset()
    )


@torch.library.custom_op("cudagraphs::rows_linear", mutates_args=())
def rows_linear(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], matvec: bool = False
) -> torch.Tensor:
    """``cat([linear(x, w_i, b_i)], -1)``: one product where the weights (and biases) lie back
    to back in one buffer, one per weight otherwise. ``biases``: one per weight, or none.
    ``matvec``: the one product of one row by the Triton kernel (``decoding/matvec.py``)
    where it applies."""
    weight = _back_to_back(weights)
    bias = _back_to_back(biases) if biases else None
    if weight is not None and (bias is not None or not biases):
        return matvec_linear(x, weight, bias) if matvec else F.linear(x, weight, bias)
    pairs = zip(weights, biases) if biases else ((w, None) for w in weights)
    return torch.cat([F.linear(x, w, b) for w, b in pairs], dim=-1)


@rows_linear.register_fake
def _(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], matvec: bool = False
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


@torch.library.custom_op("cudagraphs::gated_linear", mutates_args=())
def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """``F.linear(F.silu(gate) * up, weight, bias)`` of the fused gate/up product ``[gate,
    up]``: one kernel for a row of half or bfloat16 on a GPU (``matvec.gated_matvec``), the
    model's own three operations elsewhere."""
    if applies_gated(gate_up, weight):
        return gated_matvec(gate_up, weight, bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight, bias)


@gated_linear.register_fake
def _(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])


class _Group:
    """The projections of one group and the outputs the first call computed for the others."""

    def __init__(self, members: Sequence[nn.Linear], matvec: bool = False):
        self.members = tuple(members)
        self.matvec = matvec
        self.sizes = [m.out_features for m in members]
        self.pending: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        pending = self.pending
        if pending is not None and pending[0] is x and pending[1][index] is not None:
            outputs = pending[1]
            out = outputs[index]
            outputs[index] = None
            if all(o is None for o in outputs):
                self.pending = None
            return out
        weights = [m.weight for m in self.members]
        biases = [m.bias for m in self.members]
        if len(self.members) == 1 and not one_row(x):
            # Routed only for the one-row kernel: any other batch stays in the compiler's
            # view, which plans its output and fuses its neighbours.
            return F.linear(x, weights[0], biases[0])
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return F.linear(x, weights[index], biases[index])  # a bias removed since fusing
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            return F.linear(x, weights[index], biases[index])  # the operator has no backward
        fused = rows_linear(x, weights, [b for b in biases if b is not None], self.matvec)
        if len(self.members) == 1:
            # Nothing to hand out: keeping ``x`` would only give a compiler a tensor to guard on.
            return fused
        outputs = list(fused.split(self.sizes, dim=-1))
        out = outputs[index]
        outputs[index] = None
        self.pending = (x, outputs)
        return out


class FusedLinear(nn.Linear):
    """An ``nn.Linear`` of a fused group: its forward is its rows of the group's one product."""

    _fused_group: _Group
    _fused_index: int
    _unfused_class: type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused_group.output(x, self._fused_index)


@dataclass
class FusionReport:
    """What :func:`fuse_projections` did: the groups fused, now or by an earlier call
    (``"model.layers.0.self_attn: q_proj+k_proj+v_proj"``), and each group left alone with the
    reason."""

    fused: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    one_row: list[str] = field(default_factory=list)  # single projections on the matvec kernel
    gated: list[str] = field(default_factory=list)  # MLPs whose SiLU is in the down product

    def __str__(self) -> str:
        lines = [f"{len(self.fused)} projection groups fused, {len(self.refused)} left unfused"]
        if self.one_row:
            lines.append(f"{len(self.one_row)} single projections on the one-row kernel")
        if self.gated:
            lines.append(f"{len(self.gated)} MLPs with SiLU(gate) * up in the down product")
        lines += [f"  unfused: {why}" for why in self.refused]
        return "\n".join(lines)


def _why_not(members: Sequence[Any]) -> str:
    """Why these modules cannot be one product ("" where they can)."""
    for m in members:
        if type(m) is FusedLinear:
            return "some projections are fused and others not (a module replaced since fusing)"
        if type(m) is not nn.Linear:
            return f"{type(m).__name__} is not a plain nn.Linear"
    first = members[0]
    for m in members[1:]:
        if m.in_features != first.in_features:
            return f"input sizes differ ({first.in_features} and {m.in_features})"
        if m.weight.dtype != first.weight.dtype or m.weight.device != first.weight.device:
            return (
                f"dtypes or devices differ ({first.weight.dtype} on {first.weight.device}, "
                f"{m.weight.dtype} on {m.weight.device})"
            )
        if (m.bias is None) != (first.bias is None):
            return "a bias on some projections and not on others"
    if any(m.weight.device.type == "meta" for m in members):
        return "the weights are on the meta device"
    return ""


def fuse_projections(model: nn.Module, matvec: bool = False) -> FusionReport:
    """Fuse every q/k/v and gate/up group of ``model``'s layers in place (see the module doc);
    the report lists what was fused and what was not, and why. ``matvec``: a product of one
    row (batch-1 decoding) runs the Triton kernel of ``decoding/matvec.py`` where it
    applies, the output and down projections' too (:data:`SINGLES`, ``report.one_row``);
    groups fused by an earlier call keep their own setting, and a module whose group an
    earlier call fused without the kernel keeps its single projection and activation as they
    are (the user's ``fuse_projections(model)`` before a ``Decoder`` keeps cuBLAS's products).

    Right::

        fuse_projections(model, matvec=True)   # batch-1 decoding: every one-row product on
                                               # the kernel; other batches run F.linear

    Wrong::

        fuse_projections(model, matvec="yes")  # ConfigError: matvec is a bool
    """
    check_bool("matvec", matvec, "it says whether a one-row product runs the Triton kernel")
    report = FusionReport()
    copied = False  # a group's weights copied into a new buffer on a GPU
    for name, module in model.named_modules():
        kept = False  # a group of this module fused earlier without the kernel: keep it so
        for group in GROUPS + (SINGLES if matvec else ()):
            members = [getattr(module, n, None) for n in group]
            if not all(isinstance(m, nn.Module) for m in members):
                continue
            if len(group) == 1 and kept:
                continue
            label = f"{name or type(model).__name__}: {'+'.join(group)}"
            done = report.fused if len(group) > 1 else report.one_row
            if all(type(m) is FusedLinear for m in members):
                done.append(label)  # by an earlier call (another Decoder of the model)
                kept = kept or not members[0]._fused_group.matvec
                continue
            why = _why_not(members)
            if why:
                report.refused.append(f"{label}: {why}")
                continue
            copied = _fuse(members, matvec) or copied
            done.append(label)
        if matvec and _gates(module):
            if not getattr(module, "_ungated_class", None):
                _gate(module)
            report.gated.append(f"{name or type(model).__name__}: SiLU(gate) * up into down_proj")
    if copied and torch.cuda.is_available():
        # The weights' old storages are free now, but the caching allocator keeps them
        # reserved, and a fused buffer is larger than any block it freed: give them back.
        torch.cuda.empty_cache()
    return report


def one_row(x: torch.Tensor) -> bool:
    """Whether ``x`` is one row of inputs (every dimension but the last of size 1): what the
    one-row kernel takes. Under ``torch.compile`` a batch dimension of 1 is its own graph
    (Dynamo specializes sizes 0 and 1), so a dynamic batch adds no guard here."""
    return math.prod(x.shape[:-1]) == 1


def _silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _gates(module: nn.Module) -> bool:
    """Whether ``module`` is a gated MLP whose projections are fused for the one-row kernel:
    gate and up one group, down on its own, SiLU between (transformers' Llama, Qwen, Mistral
    MLPs)."""
    gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    return (
        all(type(m) is FusedLinear for m in (gate, up, down))
        and gate._fused_group is up._fused_group  # type: ignore[union-attr]
        and _silu(getattr(module, "act_fn", None))
    )


def _gate(module: nn.Module) -> None:
    object.__setattr__(module, "_ungated_class", type(module))
    module.__class__ = _gated_class(type(module))


@functools.cache
def _gated_class(mlp_class: type) -> type:
    """``mlp_class`` whose forward, while its projections stay as :func:`_gates` found them,
    is the fused gate/up product and :func:`gated_linear` (SiLU inside the down product); any
    other call is the class's own forward."""

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        weights = (gate.weight, up.weight, down.weight)
        training = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
        plain = training or not one_row(x) or (gate.bias is None) != (up.bias is None)
        if _gates(self) and not plain:
            biases = [b for b in (gate.bias, up.bias) if b is not None]
            fused = rows_linear(x, [gate.weight, up.weight], biases, gate._fused_group.matvec)
            return gated_linear(fused, down.weight, down.bias)
        return mlp_class.forward(self, x)

    name = f"GatedDown{mlp_class.__name__}_{mlp_class.__module__.replace('.', '_')}"
    gated = type(name, (mlp_class,), {"forward": forward, "__module__": __name__})
    # Reachable by module and name, as pickle finds a class (a saved compile's guards name it).
    globals()[name] = gated
    return gated


def _fuse(members: Sequence[nn.Linear], matvec: bool = False) -> bool:
    """Fuse ``members`` in place; whether their weights were copied into a buffer on a GPU."""
    copied = len(members) > 1 and members[0].weight.is_cuda
    with torch.no_grad():
        for attribute in ("weight", "bias") if len(members) > 1 else ():  # one: as it is
            params = [getattr(m, attribute) for m in members]
            if params[0] is None:
                continue
            buffer = torch.cat([p.detach() for p in params], dim=0)
            start = 0
            for p in params:
                p.data = buffer[start : start + p.shape[0]]  # the same Parameter, new rows
                start += p.shape[0]
    group = _Group(members, matvec)
    for index, m in enumerate(members):
        m._unfused_class = type(m)  # type: ignore[attr-defined]
        m.__class__ = FusedLinear
        # Set on the instance without registering a submodule (nothing new in state_dict).
        object.__setattr__(m, "_fused_group", group)
        object.__setattr__(m, "_fused_index", index)
    return copied


def unfuse_projections(model: nn.Module) -> int:
    """Give every fused projection of ``model`` its own class and forward back (the weights
    stay where they are: views of the shared buffer are valid parameters); how many."""
    count = 0
    for module in model.modules():
        ungated = module.__dict__.pop("_ungated_class", None)
        if ungated is not None:
            module.__class__ = ungated
        if type(module) is FusedLinear:
            module.__class__ = module._unfused_class
            for attribute in ("_fused_group", "_fused_index", "_unfused_class"):
                module.__dict__.pop(attribute, None)
            count += 1
    return count
