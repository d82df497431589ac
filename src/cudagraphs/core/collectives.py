"""[collectives] Collectives inside a graph: what each rank recorded, compared across ranks before replay.

A graph that contains collectives (an all-reduce of gradients, a tensor-parallel all-reduce)
must contain the same ones, in the same order, with the same sizes and dtypes, on every rank:
otherwise the first replay waits forever for a partner that never comes. :class:`CollectiveLog`
records the collectives a run issues (a dispatch mode: ``dist.all_reduce`` and friends, and the
functional collectives), and :func:`compare_across_ranks` exchanges the records through the
process group (a gloo group of its own, with a timeout) and raises
:class:`CollectiveMismatchError` on every rank, saying what differs, when they disagree.

Right::

    with CollectiveLog() as log:
        step(batch)                     # the run that is captured
    compare_across_ranks(log, name="step")

Wrong: replaying a graph whose collectives were never compared: a rank that captured one
all-reduce more hangs every rank at its first replay, with nothing said.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CollectiveMismatchError, explain
from .compat import OPS_DISPATCH_MODE

__all__ = ["CollectiveLog", "compare_across_ranks", "compared_across_ranks", "distributed_active"]

_NAMESPACES = ("c10d", "_c10d_functional")
_BOOKKEEPING = ("wait_tensor", "_wrap_tensor_autograd")  # not collectives themselves


def distributed_active() -> bool:
    """Whether a default process group exists (the only case in which to record)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class CollectiveLog(OPS_DISPATCH_MODE):  # type: ignore[misc, valid-type]
    """Records ``(collective, [(shape, dtype), ...])`` for each collective a run issues."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[str, tuple[tuple[tuple[int, ...], str], ...]]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # As state.WriteRecorder: otherwise Dynamo would refuse to compile under the mode.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in _NAMESPACES and not any(b in str(func) for b in _BOOKKEEPING):
            tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
            self.entries.append(
                (
                    str(func.overloadpacket.__name__),
                    tuple((tuple(t.shape), str(t.dtype)[6:]) for t in tensors),
                )
            )
        return func(*args, **(kwargs or {}))

    def describe(self) -> list[str]:
        """One line per collective: ``allreduce_ float32[1024]``."""
        return [
            f"{kind} " + ", ".join(f"{dtype}{list(shape)}" for shape, dtype in tensors)
            for kind, tensors in self.entries
        ]


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flat(item)]
    return [value]


@contextlib.contextmanager
def compared_across_ranks(name: str, timeout_s: float = 30.0) -> Iterator[None]:
    """Record the collectives issued inside, and compare them across ranks on the way out
    (only under an initialised process group, and only if there were any)."""
    if not distributed_active():
        yield
        return
    with CollectiveLog() as log:
        yield
    if log.entries:
        compare_across_ranks(log, name=name, timeout_s=timeout_s)


_groups: dict[float, Any] = {}


def compare_across_ranks(log: CollectiveLog, *, name: str, timeout_s: float = 30.0) -> None:
    """Exchange every rank's record and raise on every rank if any differs. All ranks must call
    it at the same point (right after the capture that the log recorded)."""
    dist = torch.distributed
    if timeout_s not in _groups:  # one gloo group per timeout, made by all ranks at once
        _groups[timeout_s] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    group = _groups[timeout_s]
    records: list[list[str] | None] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(records, log.describe(), group=group)
    except RuntimeError as error:
        raise CollectiveMismatchError(
            explain(
                f"{name}: not every rank reached the collective check within {timeout_s:.0f} s "
                f"({str(error).splitlines()[0] if str(error) else type(error).__name__})",
                "a rank that captures other graphs than the others would hang every rank at "
                "its first replay",
                "capture the same graphs, in the same order, on every rank",
            )
        ) from None
    mine = dist.get_rank()
    reference = records[0]
    if all(r == reference for r in records):
        return
    lines = []
    for rank, record in enumerate(records):
        if record != reference:
            lines.append(f"rank {rank}: {_difference(reference or [], record or [])}")
    raise CollectiveMismatchError(
        explain(
            f"{name}: the ranks captured different collectives (this is rank {mine}); against "
            f"rank 0: " + "; ".join(lines),
            "every rank's graph must issue the same collectives, in the same order, with the "
            "same sizes and dtypes, or the first replay waits forever",
            "make the captured step identical on every rank (no rank-dependent branches, "
            "sizes or extra collectives)",
        )
    )


def _difference(reference: list[str], other: list[str]) -> str:
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return f"collective {i} is {b!r}, rank 0 has {a!r}"
    if len(other) > len(reference):
        return f"{len(other) - len(reference)} more collective(s), first {other[len(reference)]!r}"
    return f"{len(reference) - len(other)} fewer collective(s), missing {reference[len(other)]!r}"
