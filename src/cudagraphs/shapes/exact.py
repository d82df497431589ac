"""``buckets="exact"``: one graph per exact input shape, least recently used evicted."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import optree
import torch

from ..core import NAMESPACE, Graphed
from ..errors import ConfigError, explain
from ..options import Options

__all__ = ["ExactShapes"]


class ExactShapes:
    """``buckets="exact"``: one graph per exact input shape seen, least recently used evicted.

    For workloads with a few recurring shapes that are not worth a ladder. Each graph has its own
    pool so that evicting it releases its memory. Warns when shapes keep changing (evictions).
    """

    def __init__(self, fn: Callable[..., Any], options: Options, max_graphs: int = 8):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ConfigError(
                explain(
                    f"max_graphs must be an int >= 1, got {max_graphs!r}",
                    "it bounds how many shapes keep a captured graph",
                    "pass max_graphs=8 (the default)",
                )
            )
        self.fn = fn
        self.options = options
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[Any, ...], Graphed[Any]] = OrderedDict()
        self.evictions = 0
        self._warned = False
        self.lock = threading.RLock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:  # one call at a time: the table and each graph's buffers are shared
            return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
        key = (spec, *(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves))
        graphed = self._graphs.get(key)
        if graphed is None:
            graphed = Graphed(self.fn, self.options)
            graphed.initialize(args, kwargs)
            self._graphs[key] = graphed
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)  # frees its graph and pool
                self.evictions += 1
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if not self._warned and self.evictions >= self.max_graphs:
                    warnings.warn(
                        f"cudagraphs: shapes keep changing ({self.evictions} graphs evicted, "
                        f"max_graphs={self.max_graphs}); each new shape costs a capture. Declare "
                        "a ladder with buckets=cg.Buckets(...) or raise max_graphs.",
                        stacklevel=2,
                    )
                    self._warned = True
        else:
            self._graphs.move_to_end(key)
        return graphed(*args, **kwargs)

    @property
    def graphs(self) -> int:
        return len(self._graphs)
