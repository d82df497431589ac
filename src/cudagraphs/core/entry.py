"""How a call of a graphed function reaches its replay: one frame, or the general path.

A captured graph of one positional tensor (the common case) is called through one closure
built by its :class:`~cudagraphs.core.replayer.Replayer`: lock, address guard, input check,
copy, replay and outputs in a single Python frame. ``__call__`` is a property whose getter is
C (``operator.attrgetter``), so not even a method frame stands between the caller and that
closure; on a small graph, whose replay takes tens of microseconds, one frame is measurable.
Every other call (other signatures, keyword arguments, a moved tensor, before capture, eager)
takes :meth:`Entry._entry`, the general path, which the graph class completes.
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .guards import AddressGuard
from .replayer import Replayer

__all__ = ["Entry"]

R = TypeVar("R")


class Entry(Generic[R]):
    """The call path of a graphed callable; subclasses provide ``lock``, ``_on_stale`` and
    ``_call_general``."""

    lock: threading.RLock
    _replayer: Replayer | None
    _guard: AddressGuard | None

    if TYPE_CHECKING:

        def __call__(self, *args: Any, **kwargs: Any) -> R: ...

    else:
        __call__ = property(operator.attrgetter("_entry"))  # see the module doc

    def _entry(self, *args: Any, **kwargs: Any) -> R:
        """The general call: any signature, any state."""
        with self.lock:
            guard = self._guard
            if guard is not None and (reason := guard.stale()) is not None:
                self._on_stale(reason)
            replayer = self._replayer
            if (
                replayer is not None
                and replayer.flat
                and len(args) == replayer.n_args
                and not kwargs
            ):
                return replayer.call(args, args, {})  # positional leaves: no flattening
            return self._call_general(args, kwargs)

    def _on_stale(self, reason: str) -> None:
        raise NotImplementedError

    def _call_general(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        raise NotImplementedError

    @property
    def replayer(self) -> Replayer | None:
        """The current recording and its replay path (``None`` before capture or when eager)."""
        return self._replayer

    @replayer.setter
    def replayer(self, replayer: Replayer | None) -> None:
        self._replayer = replayer
        self._rebuild_entry()

    @property
    def guard(self) -> AddressGuard | None:
        """The address guard checked before each replay (``None``: nothing read by address)."""
        return self._guard

    @guard.setter
    def guard(self, guard: AddressGuard | None) -> None:
        self._guard = guard
        self._rebuild_entry()

    def _rebuild_entry(self) -> None:
        """Point ``__call__`` at the replayer's one-frame closure where it has one, else at the
        general method. The closure reaches back to this object only weakly (no cycle: a
        dropped graph frees its memory at once)."""
        self.__dict__.pop("_entry", None)
        replayer, guard = self.__dict__.get("_replayer"), self.__dict__.get("_guard")
        if replayer is None:
            return
        entry = replayer.entry(
            self.lock,
            guard.check if guard is not None else None,
            functools.partial(_general_call, weakref.ref(self)),
        )
        if entry is not None:
            self._entry = entry  # type: ignore[method-assign]


def _general_call(
    target: weakref.ref[Entry[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The one-frame closure's way back to the general path (its caller holds the graph)."""
    graphed = target()
    assert graphed is not None
    return Entry._entry(graphed, *args, **kwargs)
