"""``cg.backend``: a torch.compile backend whose every piece is fused by Inductor and then
captured as a ``cg.graph``.

Right::

    compiled = torch.compile(model, backend=cg.backend)             # fused, then graphed
    compiled = torch.compile(model, backend=cg.backend(warmup=2))    # with cg.graph's options
    compiled = torch.compile(model, backend=cg.backend(fuse=False))  # graphed, not fused

Each traced piece goes through Inductor (kernel fusion, as ``backend="inductor"``) with
Inductor's own CUDA graphs off, so there is one graph layer: ours, with its guards, output
policy, mode and thread checks. ``fuse=False`` graphs the traced aten operations as they are
(no Inductor: no compile time, no Triton).

Dynamo splits a function at what it cannot trace (``.item()`` used in a branch, a print, a
call into an unsupported library): each traced piece is handed to this backend, and the Python
between the pieces runs eagerly at every call. So graph breaks become eager gaps with no mark:
Dynamo re-runs the decision each call and guards what the pieces assumed. Each piece is
captured lazily (its first calls run eagerly, the next one captures) with every check of
``cg.graph`` (signature, addresses, modes, threads, output policy).

Wrong: ``mode="reduce-overhead"`` together with this backend (two libraries recording the same
kernels), or ``dynamic=True``: a piece traced with symbolic sizes takes the sizes as arguments,
and a graph freezes them; leave ``dynamic`` unset or ``False`` (each new shape is a new piece).

The pieces' parameters and buffers arrive as inputs (Dynamo inlines modules); they are read in
place, by address, never copied per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..api import graph
from ..core import compat
from ..errors import ConfigError, explain
from ..options import check_bool, split_options

__all__ = ["backend"]

_BACKEND_OPTIONS = (
    "warmup", "outputs", "capture_error_mode", "fallback", "guard", "on_stale",
    "side_effects", "harmless_state", "segments",
)  # fmt: skip


class _Piece(torch.nn.Module):
    """One traced piece (``run``: the Dynamo graph, or Inductor's compile of it) with its
    parameters and buffers held (so ``cg.graph`` guards their addresses) and only the call's
    own tensors as graph inputs."""

    def __init__(self, run: Callable[..., Any], fixed: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.run = run
        self.slots = sorted(fixed)
        for k, (_, t) in enumerate(sorted(fixed.items())):
            self.register_buffer(f"fixed_{k}", t, persistent=False)

    def forward(self, *free: Any) -> Any:
        args: list[Any] = list(free)
        for k, i in enumerate(self.slots):
            args.insert(i, getattr(self, f"fixed_{k}"))
        return self.run(*args)


def _compile(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any], fuse: bool
) -> Callable[..., Any]:
    fixed_positions = compat.module_state_inputs(gm, len(example_inputs))
    state: dict[str, Any] = {}
    traced = compat.inductor_compile(gm, example_inputs) if fuse else gm

    def run(*args: Any) -> Any:
        piece = state.get("graphed")
        if piece is None:
            fixed = {
                i: a
                for i, a in enumerate(args)
                if isinstance(a, torch.Tensor)
                and (i in fixed_positions or isinstance(a, torch.nn.Parameter))
            }
            state["fixed"] = fixed
            state["free"] = [i for i in range(len(args)) if i not in fixed]
            state["graphed"] = piece = graph(_Piece(traced, fixed), **options)
        fixed = state["fixed"]
        for i, t in fixed.items():
            if args[i] is not t:
                raise ConfigError(
                    explain(
                        f"a compiled piece got another tensor object at input {i} than the "
                        "parameter or buffer it was captured with",
                        "the graph reads module state by address",
                        "update parameters in place (load_state_dict, p.copy_()) instead of "
                        "replacing them, or call torch.compiler.reset() after replacing them",
                    )
                )
        return piece(*[args[i] for i in state["free"]])

    return run


def backend(
    gm: Any = None, example_inputs: Any = None, *, fuse: bool = True, **options: Any
) -> Any:
    """The torch.compile backend (``backend=cg.backend``), or, called with options only, a
    backend that uses them (``backend=cg.backend(warmup=2)``, ``cg.backend(fuse=False)``).

    ``fuse``: compile each piece with Inductor before capturing it (default), or capture the
    traced operations unfused. The other options are ``cg.graph``'s."""
    if gm is None:
        opts, rest = split_options(None, options, allowed=_BACKEND_OPTIONS, entry="cg.backend")
        if rest:
            raise ConfigError(
                explain(
                    f"cg.backend got unknown options {sorted(rest)}",
                    f"it takes fuse= and cg.graph's options {', '.join(_BACKEND_OPTIONS)}",
                    "remove or respell them",
                )
            )
        check_bool("fuse", fuse, "it says whether Inductor fuses each piece")
        return functools.partial(backend, fuse=fuse, **opts)
    return _compile(gm, list(example_inputs or ()), options, fuse)
