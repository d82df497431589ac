"""Calls above the largest rung: refuse, run eagerly, or split into chunks of the largest rung.

The policy is ``Buckets(overflow=...)``; the bucketed callable hands such calls here, and the
chunks come back to it through its public :meth:`~.bucketed.Bucketed.run`.
"""

from __future__ import annotations

import logging
from typing import Any

import optree
import torch

from ..core import NAMESPACE, leaf_paths
from ..errors import BucketOverflowError, explain

__all__ = ["Overflow"]

log = logging.getLogger("cudagraphs")


class Overflow:
    """What a bucketed callable does above its largest rung; counts what happened."""

    def __init__(self, bucketed: Any, policy: str):
        self.bucketed = bucketed
        self.policy = policy
        self.overflows = 0
        self.eager_calls = 0
        self._warned = False

    def __call__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], real: dict[str, int]
    ) -> Any:
        bucketed = self.bucketed
        dispatch = bucketed.dispatch
        over = dispatch.above(real)
        self.overflows += 1
        if self.policy == "raise":
            s = over[0]
            raise BucketOverflowError(
                explain(
                    f"{s}={real[s]} is above the largest bucket ({dispatch.largest[s]}; ladder {list(dispatch.ladders[s])})",
                    "no graph was captured for a size this large",
                    "add a larger rung to the ladder, split the input, or pass "
                    "Buckets(overflow='eager' or 'chunk')",
                )
            )
        if self.policy == "eager":
            if not self._warned:
                log.warning(
                    "cudagraphs: %s above the largest bucket; running eagerly (counted in stats.eager_calls)",
                    ", ".join(f"{s}={real[s]}" for s in over),
                )
                self._warned = True
            self.eager_calls += 1
            return bucketed.fn(*args, **kwargs)
        return self._chunk(leaves, real, over)

    def _chunk(self, leaves: list[Any], real: dict[str, int], over: list[str]) -> Any:
        bucketed = self.bucketed
        if len(over) != 1:
            raise BucketOverflowError(
                explain(
                    f"{', '.join(over)} are all above their largest buckets",
                    "overflow='chunk' splits along one symbol at a time",
                    "raise the ladders, or use overflow='eager'",
                )
            )
        symbol = over[0]
        out_spec, out_dims = bucketed.output_dims
        out_dim: dict[int, int] = {}
        for i, dims in out_dims:
            along = [d for d, s in dims if s == symbol]
            if len(along) != 1:
                raise BucketOverflowError(
                    explain(
                        f"overflow='chunk' needs every tensor output to follow {symbol!r} in exactly one dimension",
                        f"output {leaf_paths(out_spec, root='out')[i]} does not, so chunks cannot be concatenated",
                        "use overflow='eager' or 'raise'",
                    )
                )
            out_dim[i] = along[0]
        step = bucketed.dispatch.largest[symbol]
        pieces = []
        for start in range(0, real[symbol], step):
            n = min(step, real[symbol] - start)
            chunk_leaves = list(leaves)
            for inp in bucketed.inputs:
                for d, s in inp.dims:
                    if s == symbol:
                        chunk_leaves[inp.index] = chunk_leaves[inp.index].narrow(d, start, n)
            chunk_real = dict(real, **{symbol: n})
            combo = bucketed.dispatch.choose(chunk_real)
            assert combo is not None
            out = bucketed.run(combo, chunk_leaves, chunk_real)
            # The next chunk's replay overwrites this one's outputs: keep copies.
            pieces.append(
                optree.tree_map(
                    lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                    out,
                    namespace=NAMESPACE,
                )
            )
        flat = [optree.tree_flatten(p, namespace=NAMESPACE)[0] for p in pieces]
        spec = optree.tree_flatten(pieces[0], namespace=NAMESPACE)[1]
        merged = list(flat[0])
        for i, d in out_dim.items():
            merged[i] = torch.cat([f[i] for f in flat], dim=d)
        return optree.tree_unflatten(spec, merged)
