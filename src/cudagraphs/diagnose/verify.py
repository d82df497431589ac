"""``verify=True``: replay a new graph against eager on fresh random inputs.

Right after capture, draw K inputs of the captured shapes (floats around the example's mean and
spread, integers within the example's range, booleans at random), and run the function eagerly
twice and through the graph, each from the same state: what a run writes outside its inputs
(module buffers, a KV cache and its counter) and the RNG states are put back after it. Every
output leaf is compared with a tolerance that fits its dtype.

A function that changes plain Python state it reads (a counter in its closure, ``self.step``)
is refused: the graph froze that value at capture. A function whose two eager runs from one
state and RNG still differ (randomness from elsewhere) is compared on shapes and dtypes only,
with a :class:`~cudagraphs.CudaGraphsWarning` naming the output. Verification leaves the state
as it found it.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optree
import torch

from ..core import (
    SideEffects,
    TensorSnapshot,
    Written,
    callable_name,
    flatten,
    leaf_paths,
    named_roots,
    user_stacklevel,
)
from ..errors import CudaGraphsWarning, VerificationError, explain

if TYPE_CHECKING:
    from ..core import Graphed

__all__ = [
    "compare_with_eager",
    "python_values",
    "random_like",
    "tolerance",
    "verify_against_eager",
]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """rtol/atol for comparing a replay with eager (same kernels, so tight)."""
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 1e-2, "atol": 1e-2}
    if dtype == torch.float64:
        return {"rtol": 1e-7, "atol": 1e-7}
    if dtype.is_floating_point or dtype.is_complex:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 0.0, "atol": 0.0}


def random_like(example: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh tensor of the example's shape, dtype and device, in the example's range."""
    if example.dtype == torch.bool:
        return torch.rand(example.shape, device=example.device) < 0.5
    if example.dtype.is_floating_point:
        flat = example.detach().float()
        mean = flat.mean().item() if flat.numel() else 0.0
        std = flat.std().item() if flat.numel() > 1 else 1.0
        std = std if std > 0 else 1.0
        return (torch.randn(example.shape, device=example.device) * std + mean).to(example.dtype)
    low = int(example.min().item()) if example.numel() else 0
    high = int(example.max().item()) if example.numel() else 1
    return torch.randint(low, high + 1, example.shape, device=example.device, dtype=example.dtype)


def _clone_tree(tree: Any) -> Any:
    # flatten registers dataclass outputs (transformers' ModelOutput) as nodes, so their
    # tensors are cloned rather than the whole object kept by reference.
    leaves, spec = flatten(tree)
    return optree.tree_unflatten(
        spec, [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    )


def verify_against_eager(graphed: Graphed[Any], rounds: int) -> None:
    """Raise :class:`VerificationError` if a replay differs from eager; see the module doc."""
    compare_with_eager(graphed, graphed.fn, graphed.inputs, graphed.input_kwargs, rounds)


def compare_with_eager(
    call: Callable[..., Any], fn: Callable[..., Any], args: Any, kwargs: Any, rounds: int
) -> None:
    """Raise :class:`VerificationError` if ``call`` (a graph of ``fn``, or any other way of
    running it) differs from ``fn`` run eagerly, on ``rounds`` fresh random inputs shaped like
    ``args`` and ``kwargs``, each from the same state (what the eager runs write is put back)."""
    leaves, spec = flatten((args, kwargs))
    inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
    plain = [x for x in leaves if not isinstance(x, torch.Tensor)]
    for _ in range(rounds):
        fresh = [random_like(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = optree.tree_unflatten(spec, fresh)
        before = python_values(fn)
        expected, written = _eager_from_here(fn, args, kwargs, inputs, plain)
        changed = [name for name, value in python_values(fn).items() if before.get(name) != value]
        if changed:
            raise VerificationError(
                explain(
                    f"{callable_name(fn)} changes Python state on each call: "
                    + ", ".join(changed[:5]),
                    "a graph runs the Python code once, at capture, and freezes what it read "
                    "(a counter used as an index stays at its value from capture)",
                    "keep such state in a tensor on the device and update it in place "
                    "(counter.add_(1)), or pass it as a tensor input",
                )
            )
        again, _ = _eager_from_here(fn, args, kwargs, inputs, plain)
        # The replay's writes happen inside the graph, unseen by a dispatch mode: copy what the
        # eager run wrote, replay, and put it back.
        snapshot = TensorSnapshot(zip(written.names, written.tensors))
        got = _clone_tree(call(*_clone_tree(args), **_clone_tree(kwargs)))
        snapshot.restore()
        differs = _first_difference(expected, again)
        if differs is not None:
            warnings.warn(
                f"cudagraphs: verify: {callable_name(fn)} gives different outputs on one input from "
                f"one state and RNG ({differs}): comparing shapes and dtypes only. A graph replays "
                "such randomness with its own draws.",
                CudaGraphsWarning,
                stacklevel=user_stacklevel(),
            )
        _compare(expected, got, shapes_only=differs is not None)


def _eager_from_here(
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
    inputs: list[torch.Tensor],
    plain: list[Any],
) -> tuple[Any, Written]:
    """One eager run on clones of the arguments; what it writes and the RNG are put back."""
    effects = SideEffects(fn, inputs, plain, "restore")
    call_args, call_kwargs = _clone_tree((args, kwargs))
    with effects.running():
        output = _clone_tree(fn(*call_args, **call_kwargs))
    return output, effects.finish()


def python_values(fn: Callable[..., Any]) -> dict[str, Any]:
    """Plain values ``fn`` reads outside its arguments (closure, globals, module attributes, and
    lists, tuples and dicts of them), by name: what a graph freezes at capture."""
    found: dict[str, Any] = {}
    for name, value in named_roots(fn):
        _plain_values(name, value, found, depth=0)
    return found


_PLAIN = (bool, int, float, str)


def _plain_values(name: str, value: Any, found: dict[str, Any], depth: int) -> None:
    if isinstance(value, _PLAIN):
        found[name] = value
    elif depth > 2 or len(found) > 5000:
        return
    elif isinstance(value, (list, tuple)):
        for k, item in enumerate(value[:100]):
            _plain_values(f"{name}[{k}]", item, found, depth + 1)
    elif isinstance(value, dict):
        for key, item in list(value.items())[:100]:
            _plain_values(f"{name}[{key!r}]", item, found, depth + 1)
    elif isinstance(value, torch.nn.Module):
        for module_name, module in value.named_modules(prefix=name):
            for key, item in vars(module).items():
                if not key.startswith("_") and isinstance(item, _PLAIN) and key != "training":
                    found[f"{module_name}.{key}"] = item
    elif hasattr(value, "__dict__") and not callable(value) and not inspect.ismodule(value):
        for key, item in list(vars(value).items())[:100]:
            if not key.startswith("_"):
                _plain_values(f"{name}.{key}", item, found, depth + 1)


def _first_difference(a: Any, b: Any) -> str | None:
    """The path of the first output leaf where two eager runs differ beyond tolerance."""
    la, sa = flatten(a)
    lb, sb = flatten(b)
    if sa != sb:
        return "the output structure"
    for path, x, y in zip(leaf_paths(sa, root="out"), la, lb):
        if isinstance(x, torch.Tensor):
            if not (
                isinstance(y, torch.Tensor)
                and x.shape == y.shape
                and torch.allclose(x.double(), y.double(), equal_nan=True, **tolerance(x.dtype))
            ):
                return path
        elif x != y:
            return path
    return None


def _compare(expected: Any, got: Any, *, shapes_only: bool) -> None:
    le, se = flatten(expected)
    lg, sg = flatten(got)
    if se != sg:
        raise VerificationError(
            explain(
                f"the replay returned a different structure: eager {se}, graph {sg}",
                "a graph returns what the function returned at capture",
                "make the output structure independent of input values",
            )
        )
    for path, e, g in zip(leaf_paths(se, root="out"), le, lg):
        if not isinstance(e, torch.Tensor):
            continue
        if e.shape != g.shape or e.dtype != g.dtype:
            raise VerificationError(
                explain(
                    f"{path}: eager gives {tuple(e.shape)} {e.dtype}, the graph {tuple(g.shape)} {g.dtype}",
                    "the output's shape depends on input values, which a graph freezes",
                    "make output shapes depend on input shapes only",
                )
            )
        if shapes_only:
            continue
        tol = tolerance(e.dtype)
        if not torch.allclose(g.double(), e.double(), equal_nan=True, **tol):
            error = (g.double() - e.double()).abs().max().item()
            raise VerificationError(
                explain(
                    f"{path} differs from eager on fresh random inputs: max abs error {error:.3e} "
                    f"(rtol {tol['rtol']}, atol {tol['atol']})",
                    "the recording froze something that eager recomputes: a Python branch or "
                    "constant, a value read with .item(), or a tensor rebound after capture",
                    "run cg.doctor(fn, *args) to find the line, pass the changing value as a "
                    "tensor input, or use torch.where instead of `if`",
                )
            )
