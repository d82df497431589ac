"""``verify=True``: replay a new graph against eager on fresh random inputs.

Right after capture, draw K inputs of the captured shapes (floats around the example's mean and
spread, integers within the example's range, booleans at random), run the function eagerly and
through the graph on equal copies, and compare every output leaf with a tolerance that fits its
dtype. A function whose eager output is itself random (two eager runs on one input differ:
dropout, sampling) is compared on shapes and dtypes only, and the note says so.

Eager runs have the function's side effects (module buffers, RNG draws), as any call would.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import optree
import torch

from ..core.tree import NAMESPACE, leaf_paths
from ..errors import VerificationError, explain

if TYPE_CHECKING:
    from ..core.graphed import Graphed

__all__ = ["random_like", "tolerance", "verify_against_eager"]

log = logging.getLogger("cudagraphs")


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
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, namespace=NAMESPACE
    )


def verify_against_eager(graphed: Graphed[Any], rounds: int) -> None:
    """Raise :class:`VerificationError` if a replay differs from eager; see the module doc."""
    leaves, spec = optree.tree_flatten((graphed.inputs, graphed.input_kwargs), namespace=NAMESPACE)
    fn = graphed.fn
    for _ in range(rounds):
        fresh = [random_like(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = optree.tree_unflatten(spec, fresh)
        eager_args, eager_kwargs = _clone_tree((args, kwargs))
        expected = _clone_tree(fn(*eager_args, **eager_kwargs))
        again_args, again_kwargs = _clone_tree((args, kwargs))
        again = fn(*again_args, **again_kwargs)
        got = _clone_tree(graphed(*_clone_tree(args), **_clone_tree(kwargs)))
        random = not _equal(expected, again)
        if random:
            log.info(
                "cudagraphs: verify: %s gives different eager outputs on one input (random: "
                "dropout, sampling); comparing shapes and dtypes only",
                fn,
            )
        _compare(expected, got, shapes_only=random)


def _equal(a: Any, b: Any) -> bool:
    la, sa = optree.tree_flatten(a, namespace=NAMESPACE)
    lb, sb = optree.tree_flatten(b, namespace=NAMESPACE)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _compare(expected: Any, got: Any, *, shapes_only: bool) -> None:
    le, se = optree.tree_flatten(expected, namespace=NAMESPACE)
    lg, sg = optree.tree_flatten(got, namespace=NAMESPACE)
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
