"""The validated options of ``cg.graph``, shared by plain, bucketed and exact-shape graphs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import capture as _capture
from .errors import ConfigError, explain
from .outputs import OUTPUT_POLICIES
from .pool import Pool

__all__ = ["Options"]


class Options:
    """The validated options of ``cg.graph``; see :func:`cudagraphs.graph` for their meaning."""

    __slots__ = (
        "capture_error_mode",
        "fallback",
        "guard",
        "modules",
        "on_stale",
        "outputs",
        "pool",
        "stream",
        "verify",
        "warmup",
    )

    def __init__(
        self,
        *,
        warmup: int = 3,
        outputs: str = "guarded",
        pool: Any = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        fallback: str = "raise",
        guard: str = "replay",
        on_stale: str = "recapture",
        modules: Sequence[torch.nn.Module] = (),
        verify: bool | int = False,
    ):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(
                explain(
                    f"warmup must be an int >= 0, got {warmup!r}",
                    "it is the number of eager calls run before capture",
                    "pass warmup=3 (the default) or more for torch.compile'd functions",
                )
            )
        _choice("outputs", outputs, OUTPUT_POLICIES)
        _choice("capture_error_mode", capture_error_mode, _capture.CAPTURE_ERROR_MODES)
        _choice("fallback", fallback, ("raise", "eager"))
        _choice("guard", guard, ("replay", "capture"))
        _choice("on_stale", on_stale, ("recapture", "raise"))
        modules = tuple(modules)
        if not all(isinstance(m, torch.nn.Module) for m in modules):
            raise ConfigError(
                explain(
                    "modules must be a sequence of torch.nn.Module",
                    "their parameters and buffers are the tensors the graph reads by address",
                    "pass modules=[model] (the modules fn uses that are not fn itself)",
                )
            )
        if isinstance(verify, bool):
            verify = 3 if verify else 0
        if not isinstance(verify, int) or verify < 0:
            raise ConfigError(
                explain(
                    f"verify must be a bool or an int >= 0, got {verify!r}",
                    "it is the number of fresh random inputs a new graph is checked on",
                    "pass verify=True (3 inputs) or verify=5",
                )
            )
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise ConfigError(
                explain(
                    f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}",
                    "capture needs a CUDA side stream to record on",
                    "pass stream=torch.cuda.Stream(), or leave it out",
                )
            )
        pool = getattr(pool, "pool", pool)  # a graphed callable: share its pool
        if (
            pool is not None
            and not isinstance(pool, Pool)
            and not (
                isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(p, int) for p in pool)
            )
        ):
            raise ConfigError(
                explain(
                    f"pool must be a cg.Pool, a graph pool handle or a graphed callable, got {pool!r}",
                    "graphs that share a pool share one block of GPU memory",
                    "pass pool=cg.Pool() (shared by every graph given it), "
                    "pool=torch.cuda.graph_pool_handle(), or pool=other_graphed",
                )
            )
        self.warmup = warmup
        self.outputs = outputs
        self.pool = pool
        self.stream = stream
        self.capture_error_mode = capture_error_mode
        self.fallback = fallback
        self.guard = guard
        self.on_stale = on_stale
        self.modules = modules
        self.verify = verify

    def replace(self, **changes: Any) -> Options:
        """A copy with some options changed (validated again)."""
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(changes)
        return Options(**values)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            explain(
                f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}",
                f"{name} selects a fixed behaviour and accepts only these names",
                f"pass {name}={allowed[0]!r}",
            )
        )
