"""What one request to a batcher must look like, and how requests become a batch and back.

:class:`RequestSpec` is read off an example request (the positional arguments of one call):
each tensor leaf has a leading batch dimension of any size and fixed trailing dimensions, dtype
and device; plain leaves are fixed. A request is checked against it before it is queued, so a
bad one fails alone with a message that names the argument; :func:`concatenate` and
:func:`split` turn checked requests into one batch and the batch's output back into each
request's own rows (copies: the caller never holds graph memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..core import NAMESPACE, leaf_paths, same_value
from ..errors import ConfigError, InputMismatchError, explain

__all__ = ["RequestSpec", "concatenate", "split", "to_device"]


@dataclass(frozen=True)
class _TensorLeaf:
    index: int
    path: str
    trailing: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device  # where requests arrive
    compute_device: torch.device  # where the function takes the batch


class RequestSpec:
    """The structure, trailing shapes, dtypes and devices every request must have.

    ``request_device``: where request tensors arrive (``None``: on the example's device). A
    batch is moved to the example's device once, after concatenation."""

    def __init__(
        self,
        example_args: tuple[Any, ...],
        max_rows: int,
        request_device: torch.device | None = None,
    ):
        leaves, self.spec = optree.tree_flatten(example_args, namespace=NAMESPACE)
        paths = leaf_paths(self.spec, root="args")
        self.max_rows = max_rows
        self.tensors: list[_TensorLeaf] = []
        self.plain: list[tuple[int, str, Any]] = []
        for i, (leaf, path) in enumerate(zip(leaves, paths)):
            if isinstance(leaf, torch.Tensor):
                if leaf.dim() == 0:
                    raise ConfigError(
                        explain(
                            f"the example's {path} is a 0-dim tensor",
                            "requests are batched along their first dimension",
                            "give every tensor input a leading batch dimension, e.g. x[None]",
                        )
                    )
                arrives_on = request_device if request_device is not None else leaf.device
                self.tensors.append(
                    _TensorLeaf(i, path, tuple(leaf.shape[1:]), leaf.dtype, arrives_on, leaf.device)
                )
            else:
                self.plain.append((i, path, leaf))
        if not self.tensors:
            raise ConfigError(
                explain(
                    "the example request has no tensor",
                    "a batcher concatenates tensors along their first dimension",
                    "pass an example request such as torch.randn(1, 16)",
                )
            )

    def check(self, args: tuple[Any, ...]) -> tuple[list[Any], int]:
        """The request's leaves and its number of rows; :class:`InputMismatchError` if it cannot
        join a batch (the message names the argument, what was expected and what came)."""
        leaves, spec = optree.tree_flatten(args, namespace=NAMESPACE)
        if spec != self.spec:
            raise _mismatch(
                f"the request's structure {spec} differs from the example's {self.spec}",
                "pass the same arguments, nested the same way, as the example request",
            )
        rows = None
        for t in self.tensors:
            x = leaves[t.index]
            if not isinstance(x, torch.Tensor):
                raise _mismatch(
                    f"{t.path} is {type(x).__name__}, expected a tensor", "pass a tensor"
                )
            expected = f"(rows, {', '.join(map(str, t.trailing))})" if t.trailing else "(rows,)"
            if x.dim() != len(t.trailing) + 1 or tuple(x.shape[1:]) != t.trailing:
                raise _mismatch(
                    f"{t.path} has shape {tuple(x.shape)}, expected {expected}",
                    f"send {t.path} with shape {expected}",
                )
            if x.dtype != t.dtype or x.device != t.device:
                raise _mismatch(
                    f"{t.path} is {x.dtype} on {x.device}, expected {t.dtype} on {t.device}",
                    f"convert it: x.to({str(t.device)!r}, {t.dtype})",
                )
            if rows is None:
                rows = x.shape[0]
            elif x.shape[0] != rows:
                raise _mismatch(
                    f"{t.path} has {x.shape[0]} rows, other inputs of the request {rows}",
                    "give every tensor of one request the same number of rows",
                )
        for i, path, value in self.plain:
            if not same_value(leaves[i], value):  # the rule graphs freeze values by
                raise _mismatch(
                    f"{path} is {leaves[i]!r}, but the batcher was built with {value!r}",
                    "plain arguments are fixed for a batcher; build one per value",
                )
        assert rows is not None
        if not 1 <= rows <= self.max_rows:
            raise _mismatch(
                f"the request has {rows} rows; this batcher takes 1..{self.max_rows}",
                f"split the request into pieces of at most {self.max_rows} rows",
            )
        return leaves, rows


def _mismatch(what: str, fix: str) -> InputMismatchError:
    return InputMismatchError(
        explain(what, "requests are concatenated along the first dimension into one batch", fix)
    )


def concatenate(spec: RequestSpec, requests: Sequence[list[Any]]) -> tuple[Any, ...]:
    """One batch of the requests' leaves, concatenated along dimension 0, as arguments, on the
    device the function takes them (one copy per input when requests arrive elsewhere)."""
    leaves = list(requests[0])
    for t in spec.tensors:
        parts = [r[t.index] for r in requests]
        batch = parts[0] if len(parts) == 1 else torch.cat(parts)
        leaves[t.index] = batch.to(t.compute_device) if t.device != t.compute_device else batch
    return optree.tree_unflatten(spec.spec, leaves)


def to_device(output: Any, device: torch.device) -> Any:
    """``output`` with every tensor moved to ``device`` (one copy per tensor)."""
    if isinstance(output, torch.Tensor):
        return output.to(device)
    return optree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf,
        output,
        namespace=NAMESPACE,
    )


def split(output: Any, rows: Sequence[int]) -> list[Any]:
    """Each request's rows of the batch's output, as owned copies, in request order."""
    single = isinstance(output, torch.Tensor)  # the common case: no tree to walk
    leaves, spec = ([output], None) if single else optree.tree_flatten(output, namespace=NAMESPACE)
    total = sum(rows)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.shape[0] != total):
            raise ConfigError(
                explain(
                    f"the function returned a tensor of shape {tuple(leaf.shape)} for a batch "
                    f"of {total} rows",
                    "each request gets its own rows of every output, so every tensor output "
                    "needs the batch as its first dimension",
                    "return per-row results (reduce per row, not over the batch)",
                )
            )
    if single:
        return [part.clone() for part in output.split(list(rows))]
    answers = []
    start = 0
    for n in rows:
        mine = [
            leaf[start : start + n].clone() if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        answers.append(optree.tree_unflatten(spec, mine))
        start += n
    return answers
