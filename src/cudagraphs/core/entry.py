"""How a call of a graphed function reaches its replay.

Under the graph's lock: the address guard (a moved tensor captures again or raises), then the
captured graph's :meth:`~cudagraphs.core.replayer.Replayer.call`, the one replay path, for a
call of positional leaves (no flattening), or the general path, which the graph class completes
(other signatures, keyword arguments, before capture, eager). A call that finds outputs of an
earlier call still held by another thread is answered eagerly (``replayer.OutputsInUse``).
"""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

from .guards import AddressGuard
from .replayer import OutputsInUse, Replayer

__all__ = ["Entry"]

R = TypeVar("R")
_NO_KWARGS: dict[str, Any] = {}  # read only: what a positional call's explanation is given


class Entry(Generic[R]):
    """The call path of a graphed callable; subclasses provide ``_on_stale``,
    ``_call_general`` and ``answer_eagerly``."""

    lock: threading.RLock
    #: The current recording and its replay path (``None`` before capture or when eager).
    replayer: Replayer | None = None
    #: The address guard checked before each replay (``None``: nothing read by address).
    guard: AddressGuard | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        with self.lock:
            try:
                guard = self.guard
                if guard is not None and not guard.check() and (reason := guard.stale()):
                    self._on_stale(reason)  # the common answer, check(), is one C call
                replayer = self.replayer
                if (
                    replayer is not None
                    and replayer.flat
                    and len(args) == replayer.n_args
                    and not kwargs
                ):
                    return replayer.call(args, args, _NO_KWARGS)  # positional: no flattening
                return self._call_general(args, kwargs)
            except OutputsInUse:
                return self.answer_eagerly(args, kwargs)

    def _on_stale(self, reason: str) -> None:
        raise NotImplementedError

    def _call_general(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        raise NotImplementedError

    def answer_eagerly(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        raise NotImplementedError
