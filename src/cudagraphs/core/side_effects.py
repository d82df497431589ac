"""The ``side_effects`` option: runs made on the library's own account leave no trace.

Warm-up on the examples, bucket probes, recaptures, verification and the doctor run the function
for real. :class:`SideEffects` wraps such runs: with ``"restore"`` (the default) every tensor they
write outside the call's inputs and the RNG states are put back afterwards (see
:mod:`cudagraphs.core.written_state` for how writes are found), ``"keep"`` lets the runs count, and
``"raise"`` puts everything back and refuses (:class:`~cudagraphs.errors.StateWriteError`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..errors import CudaGraphsWarning, StateWriteError, explain
from .frames import callable_name, user_stacklevel
from .reach import is_compiled, reachable_tensors
from .written_state import Snapshot, Versions, WriteRecorder, Written, storage_key

__all__ = ["SideEffects", "report"]

log = logging.getLogger("cudagraphs")


class SideEffects:
    """Runs made on the library's own account (warm-up, probes), undone afterwards.

    ``policy`` is the ``side_effects`` option: ``"restore"`` puts every written tensor and the
    RNG states back, ``"keep"`` leaves them (the runs count, as before), ``"raise"`` puts them
    back and then raises :class:`~cudagraphs.errors.StateWriteError`. Use :meth:`running` around
    the runs, then :meth:`finish`.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        inputs: Iterable[torch.Tensor],
        roots: Iterable[Any],
        policy: str,
    ) -> None:
        self.policy = policy
        self.written = Written()
        self.unrestored: list[str] = []
        if policy == "keep":
            return
        inputs = list(inputs)
        reachable = reachable_tensors(fn, roots, exclude=inputs)
        self._versions = Versions(reachable)
        # Compiled kernels write unseen by the dispatch mode: copy their reachable state up
        # front (parameters excepted: only optimizer steps write those, and train_step warms
        # up with real steps instead).
        self._snapshot = (
            Snapshot((n, t) for n, t in reachable if not isinstance(t, torch.nn.Parameter))
            if is_compiled(fn)
            else None
        )
        names = {storage_key(t): n for n, t in reachable}
        self._recorder = WriteRecorder(exclude=inputs, names=names)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if self.policy == "keep":
            yield
            return
        with self._recorder:
            yield

    def finish(self) -> Written:
        """Restore (unless ``keep``); return what the runs wrote. Raises under ``raise``."""
        if self.policy == "keep":
            return self.written
        written = self._recorder.written()
        seen = set(map(storage_key, written.tensors))
        if self._snapshot is not None:
            extra = self._snapshot.written()
            for name, t in zip(extra.names, extra.tensors):
                if storage_key(t) not in seen:
                    written.names.append(name)
                    written.tensors.append(t)
                    seen.add(storage_key(t))
            written.nbytes += extra.nbytes
            self._snapshot.restore()
        self._recorder.restore()
        self.unrestored = self._versions.changed(ignore=written.tensors)
        self.written = written
        return written


_warned: set[str] = set()


def report(effects: SideEffects, fn: Callable[..., Any]) -> None:
    """After :meth:`SideEffects.finish` on warm-up: log what was put back, warn about what could
    not be, and raise under ``side_effects="raise"``."""
    written = effects.written
    name = callable_name(fn)
    if effects.unrestored:
        message = (
            f"cudagraphs: warm-up of {name} changed {', '.join(effects.unrestored[:5])}, which "
            "could not be put back (written from compiled code that cudagraphs could not copy "
            "first); capture lazily (cg.graph(fn) without examples) so warm-up calls are your "
            "real calls, or pass side_effects='keep' to accept it"
        )
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, CudaGraphsWarning, stacklevel=user_stacklevel())
    if not written.names:
        return
    if effects.policy == "raise":
        raise StateWriteError(
            explain(
                f"warm-up of {name} wrote {', '.join(written.names[:5])} (put back)",
                "side_effects='raise' refuses runs that change state outside the inputs",
                "pass side_effects='restore' (the default: warm-up's writes are undone), "
                "or capture lazily so warm-up calls are your real calls",
            ),
            names=written.names,
        )
    log.info(
        "cudagraphs: warm-up of %s wrote %s; put back (%d bytes)",
        name,
        ", ".join(written.names[:8]),
        written.nbytes,
    )
