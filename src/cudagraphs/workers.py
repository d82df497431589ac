"""A worker thread that holds its owner (an engine, a batcher) only while the owner has work,
so that an owner no one holds any more is collected once idle and its worker ends.

A thread whose target is a bound method keeps its object alive for as long as it runs: a
``Batcher`` or an ``Engine`` built in a function and never closed would keep its graphs, its
cache and its thread for the life of the process. Here the thread holds a weak reference;
idle, it waits on the owner's condition holding nothing else, and a submit holds the owner
(:func:`hold`) until the worker finds it idle again, so a request queued just before the last
reference went is still served.

Right::

    self._worker = start_worker(self, self._wake, "cudagraphs-engine", Engine._idle,
                                Engine._work)      # functions of the class, not bound methods
    # in submit, under self._wake:  queue.append(request); hold(self); self._wake.notify()

Wrong: ``target=self._serve`` (the thread holds ``self`` until the loop returns).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["hold", "start_worker"]

T = TypeVar("T")

#: The owners with work queued or running: held here from a submit until their worker finds
#: them idle.
_WORKING: set[Any] = set()


def hold(owner: Any) -> None:
    """Keep ``owner`` alive until its worker finds it idle (call under its condition, where
    work is queued)."""
    _WORKING.add(owner)


def start_worker(
    owner: T,
    condition: threading.Condition,
    name: str,
    idle: Callable[[T], bool],
    work: Callable[[T], bool],
    *,
    context: Callable[[T], contextlib.AbstractContextManager[Any]] | None = None,
) -> threading.Thread:
    """Start a daemon thread ``name`` that, while ``owner`` lives: waits on ``condition``
    while ``idle(owner)`` (called under it), then calls ``work(owner)`` (outside it) and
    stops when that returns False. ``context(owner)``: entered around the whole loop (the
    modes or the device the work runs under). When ``owner`` is collected the thread wakes
    and ends."""
    weakref.finalize(owner, _wake_up, condition)
    thread = threading.Thread(
        target=_run,
        args=(weakref.ref(owner), condition, idle, work, context),
        name=name,
        daemon=True,
    )
    thread.start()
    return thread


def _run(
    owner_ref: weakref.ref[Any],
    condition: threading.Condition,
    idle: Callable[[Any], bool],
    work: Callable[[Any], bool],
    context: Callable[[Any], contextlib.AbstractContextManager[Any]] | None,
) -> None:
    owner = owner_ref()
    if owner is None:
        return
    with context(owner) if context is not None else contextlib.nullcontext():
        while True:
            with condition:
                while owner is not None and idle(owner):
                    _WORKING.discard(owner)
                    owner = None  # idle: the owner may be collected while this waits
                    if owner_ref() is not None:  # else it was collected just now, here
                        condition.wait()
                    owner = owner_ref()
            if owner is None or not work(owner):
                return


def _wake_up(condition: threading.Condition) -> None:
    """An owner was collected: its worker, waiting idle, ends."""
    with condition:
        condition.notify_all()
