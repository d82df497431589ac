"""The one replay path: check, copy-in, replay, invalidate the previous outputs, write-back, outputs.

A :class:`Replayer` is one captured graph with its static inputs and outputs. Plain graphs,
buckets and exact shapes all replay through it: :meth:`Replayer.call` for a call whose
arguments still need checking and copying, :meth:`Replayer.replay_static` for a caller that
filled the static buffers itself. Everything the check needs is precomputed here, once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CudaGraphsError, ReplayTimeoutError, explain
from .addresses import compiled_module
from .outputs import make_emitter
from .tree import Signature

__all__ = ["Counters", "Replayer"]

log = logging.getLogger("cudagraphs")


@dataclass
class Counters:
    """Replays, input copies and write-backs, kept across recaptures."""

    replays: int = 0
    copies: int = 0
    writebacks: int = 0


class _Mismatch(Exception):
    """Raised inside the fast check; the slow check then explains what differed."""


class Replayer:
    """A captured graph and what a call needs to replay it; see the module doc."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        signature: Signature,
        static: list[Any],
        mutated: list[int],
        output: Any,
        policy: str,
        counters: Counters,
        *,
        timeout_s: float | None = None,
        name: str = "the graph",
    ):
        self.graph = graph
        # With a timeout, each replay waits for the GPU (at most timeout_s) before returning.
        self.wait: Callable[[], None] | None = (
            functools.partial(wait_for_replay, timeout_s, name) if timeout_s else None
        )
        self.signature = signature
        self.counters = counters
        emitter = make_emitter(output, policy)
        self._guarded_parts = getattr(emitter, "single_parts", lambda: None)()
        self.emit: Callable[[], Any] = getattr(emitter, "emit", emitter)
        self.invalidate: Callable[[], None] | None = getattr(emitter, "invalidate", None)
        self.writeback = tuple((i, static[i]) for i in mutated)
        if mutated:
            log.info(
                "cudagraphs: the function mutates %s in place; replays copy the result back to "
                "the caller's tensors",
                ", ".join(signature.paths[i] for i in mutated),
            )
        self.slots = tuple(
            (i, x, x.data_ptr(), x.shape, x.dtype, x.get_device(), x.stride())
            for i, x in ((i, static[i]) for i in signature.tensor_index)
        )
        # Plain values frozen at capture. The rule (tree.same_value): the same object, or the
        # same type and equal; ``1`` is not a captured ``True``.
        self.frozen = tuple(zip(signature.frozen_index, signature.frozen_values))
        self.flat = signature.is_flat  # positional leaves only: calls need no flattening
        self.n_args = signature.spec.num_leaves

    def call(self, leaves: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Check each leaf against the capture, copy the tensors that need it, replay.

        The check is a flat loop over what capture precomputed; any doubt (a non-tensor, a
        stale output, a value that compares oddly) goes to the slow check, which explains.
        """
        copied = self._copy_in(leaves, args, kwargs)
        self._replay()
        if self.wait is not None:
            self.wait()
        counters = self.counters
        counters.replays += 1
        counters.copies += copied
        if self.writeback:
            self._write_back(leaves)
        return self.emit()

    def entry(
        self,
        lock: threading.RLock,
        unchanged: Callable[[], bool] | None,
        fallback: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    ) -> Callable[..., Any] | None:
        """The whole call, in one frame, for a graph of one positional tensor and nothing else
        (the common case); ``None`` for any other signature.

        Under ``lock``, with the address guard's one-call ``unchanged`` check (``None``: no
        guard): a call that does not fit (keyword arguments, another arity, anything the guard
        watches changed) goes to ``fallback(args, kwargs)``, the general path, which explains
        or recaptures. Only what must precede the replay comes before it; everything the call
        reads is a local of this closure.
        """
        if not (self.flat and self.n_args == 1 and len(self.slots) == 1 and not self.frozen):
            return None
        if self.writeback or self.wait is not None:
            return None
        _, buf, ptr, shape, dtype, dev, stride = self.slots[0]
        invalidate = self.invalidate
        compiled = compiled_module()
        if compiled is not None and hasattr(compiled, "Entry"):
            # The same steps in C: no Python frame at all between the caller and the replay.
            return compiled.Entry(
                acquire=lock.acquire, release=lock.release, unchanged=unchanged,
                fallback=fallback, explain=functools.partial(_explain_args, self.signature),
                buf=buf, shape=shape, dtype=dtype, device=dev, address=ptr, stride=stride,
                copy=buf.copy_, invalidate=invalidate, replay=self.graph.replay, emit=self.emit,
                counters=self.counters, guarded=self._guarded_parts,
            )  # fmt: skip
        # Nothing here refers back to this Replayer: no cycle, so dropping it frees the graph
        # at once (a recapture releases the old recording before making the new one).
        replay, emit, counters, signature = (
            self.graph.replay,
            self.emit,
            self.counters,
            self.signature,
        )

        acquire, release = lock.acquire, lock.release  # cheaper than a with-statement

        def call(*args: Any, **kwargs: Any) -> Any:
            acquire()
            try:
                if kwargs or len(args) != 1 or (unchanged is not None and not unchanged()):
                    return fallback(args, kwargs)
                x = args[0]
                copied = 0
                if x is not buf:
                    try:
                        if x.shape != shape or x.dtype is not dtype or x.get_device() != dev:
                            raise _Mismatch
                        moved = x.data_ptr() != ptr or x.stride() != stride  # stale output raises
                    except Exception:
                        _explain(signature, args, {})
                        raise
                    if moved:
                        buf.copy_(x)
                        copied = 1
                try:
                    replay()
                finally:  # after the launch: see _replay
                    if invalidate is not None:
                        invalidate()
                counters.replays += 1
                counters.copies += copied
                return emit()
            finally:
                release()

        return call

    def _copy_in(self, leaves: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Check every leaf and copy the tensors that are not already in place; how many."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        try:
            for i, buf, ptr, shape, dtype, dev, stride in self.slots:
                x = leaves[i]
                if x is buf:
                    continue
                if x.shape != shape or x.dtype is not dtype or x.get_device() != dev:
                    raise _Mismatch
                if x.data_ptr() == ptr and x.stride() == stride:
                    continue
                dst.append(buf)
                src.append(x)
            for i, value in self.frozen:
                x = leaves[i]
                if x is not value and (type(x) is not type(value) or x != value):
                    raise _Mismatch
        except Exception:
            self.explain_mismatch(args, kwargs)
            raise
        if dst:
            # One multi-tensor kernel for several inputs: fewer launches in front of the replay.
            if len(dst) > 1:
                torch._foreach_copy_(dst, src)
            else:
                dst[0].copy_(src[0])
        return len(dst)

    def replay_static(self) -> Any:
        """Replay on whatever the static input buffers hold now; return the outputs."""
        self._replay()
        if self.wait is not None:
            self.wait()
        self.counters.replays += 1
        return self.emit()

    def _replay(self) -> None:
        """Launch the replay, then mark the outputs of the previous one dead.

        Marking them dead is host work; after the launch it overlaps the GPU's work instead of
        delaying it. The calling thread is inside this call, and a read it queued earlier runs
        before the replay on the stream. Another thread reading an output without the graph's
        lock races with this replay in either order; holding the lock is what protects it.
        A launch that fails marks them dead too (it may have overwritten them).
        """
        try:
            self.graph.replay()
        finally:
            if self.invalidate is not None:
                self.invalidate()

    def release_outputs(self) -> None:
        """Mark the outputs handed out so far dead (before the graph is replaced)."""
        if self.invalidate is not None:
            self.invalidate()

    def _write_back(self, leaves: Any) -> None:
        # The function mutated these inputs in place; eager would have mutated the caller's
        # tensors, so copy the graph's result back unless the caller passed the buffer itself.
        back_dst = []
        back_src = []
        for i, buf in self.writeback:
            if leaves[i] is not buf:
                back_dst.append(leaves[i])
                back_src.append(buf)
        if back_dst:
            torch._foreach_copy_(back_dst, back_src)
            self.counters.writebacks += len(back_dst)

    def explain_mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise the precise error for a call the fast check refused."""
        _explain(self.signature, args, kwargs)


def _explain_args(signature: Signature, args: tuple[Any, ...]) -> None:
    _explain(signature, args, {})


def _explain(signature: Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        signature.check(args, kwargs)
    except CudaGraphsError as error:
        # Raised from inside the fast check's except block: drop that internal context.
        raise error from None
    # The fast check is stricter than nothing only where the slow one agrees; if they ever
    # disagree, refusing is the safe answer.
    raise AssertionError("cudagraphs: fast and slow signature checks disagree; please report")


def wait_for_replay(
    timeout_s: float, name: str, done: Callable[[], bool] | None = None, poll_s: float = 1e-4
) -> None:
    """Wait until the work launched so far on the current stream is done (``done``: the test,
    by default a CUDA event recorded now), or raise :class:`ReplayTimeoutError` naming ``name``
    after ``timeout_s`` seconds."""
    if done is None:
        event = torch.cuda.Event()
        event.record()
        done = event.query
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise ReplayTimeoutError(
                explain(
                    f"the replay of {name} did not finish within {timeout_s:g} s",
                    "a collective in the graph waits for ranks that did not replay theirs (a "
                    "rank stopped, failed, or took another branch), or the graph's work is "
                    "longer than the timeout",
                    "look at the other ranks' errors first; raise replay_timeout_s if the work "
                    "is simply long. The GPU may still be waiting: restart the process group",
                )
            )
        time.sleep(poll_s)
