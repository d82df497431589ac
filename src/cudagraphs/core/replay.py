"""The one replay path (check, copy-in, replay, invalidate the previous outputs, write-back,
outputs) and the output policies.

A :class:`Replayer` is one captured graph with its static inputs and outputs. Plain graphs,
buckets, exact shapes and training steps all replay through it: :meth:`Replayer.call` for a call
whose arguments still need checking and copying, :meth:`Replayer.enter` then
:meth:`Replayer.replay_static` for a caller that fills the static buffers itself. Everything the
check needs is precomputed here, once. Before anything is written, every replay checks

1. the modes (``modes.Modes``: autocast, grad and inference mode, TF32...) against the capture's;
2. gradients: under grad mode, that nothing the call reads requires grad (a replay records no
   autograd history);
3. the calling thread. Guarded outputs alias the graph's memory, and a read from one thread
   can race with another thread's replay in either order, so once a second thread calls, every
   output is a copy made under the graph's lock (one ``CudaGraphsWarning``). Outputs handed
   out before that switch are the one remaining hazard: while any of them is still referenced,
   a call from another thread is answered eagerly (:class:`OutputsInUse`) rather than
   replaying over memory someone may be reading.

What a replay hands back (the output policies) is :mod:`~cudagraphs.core.outputs`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CudaGraphsError, CudaGraphsWarning, ReplayTimeoutError, explain
from . import compat
from .frames import user_stacklevel
from .launch import CopyNodes, InputCopying, Launcher
from .modes import Modes, newly_requiring_grad, refuse_gradients
from .outputs import make_emitter
from .segments import Segments
from .signature import Signature

__all__ = ["Counters", "OutputsInUse", "Replayer", "StreamOrder"]

log = logging.getLogger("cudagraphs")
_get_ident = threading.get_ident


class StreamOrder:
    """Keeps the replays of graphs that share memory (one graph, or one pool's) in call order
    across streams.

    The stream of the last replay is remembered. A replay on another stream (another thread's,
    or the same thread's under ``torch.cuda.stream``) first makes its stream wait for what is
    queued on that one: its copy into the static inputs must not overtake the last replay still
    reading them, nor its replay overwrite memory the last caller's stream still reads (an
    output being copied out, a shared pool's scratch). On one stream nothing is added.
    """

    def __init__(self, device: int | None = None) -> None:
        #: The current stream's handle on the device; ``None`` without CUDA (nothing to order).
        self.read = compat.current_stream_handle(device)
        self.last: int | None = None

    def follow(self) -> None:
        """Order the current stream after the last replay's (call where they differ)."""
        assert self.read is not None
        current = self.read()
        if self.last is not None:
            device = self.read.args[0]
            event = torch.cuda.Event()
            event.record(torch.cuda.ExternalStream(self.last, device=device))
            torch.cuda.current_stream(device).wait_event(event)
        self.last = current


@dataclass
class Counters:
    """Replays, input copies and write-backs, kept across recaptures."""

    replays: int = 0
    copies: int = 0
    writebacks: int = 0


class _Mismatch(Exception):
    """Raised inside the fast check; the slow check then explains what differed."""


class OutputsInUse(Exception):
    """Internal: another thread still holds outputs of this graph from before a second thread
    called it; the caller answers this call by running the function eagerly."""


class InputsAlias(OutputsInUse):
    """Internal: an input the function writes in place shares memory with another input of
    this call (``g(x, x)``), which the capture's separate buffers cannot reproduce: eager's
    write would be seen through the other input, the replay's not. Answered eagerly too."""


def _share_memory(leaves: Sequence[Any], pairs: Sequence[tuple[int, int]]) -> bool:
    """Whether, for some pair, both inputs are non-empty tensors of one storage."""
    for i, j in pairs:
        a, b = leaves[i], leaves[j]
        if (
            a.numel()
            and b.numel()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        ):
            return True
    return False


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
        modes: Modes | None = None,
        grad_sources: Sequence[torch.Tensor] | None = (),
        timeout_s: float | None = None,
        name: str = "the graph",
        copies: CopyNodes | None = None,
        device: int | None = None,
        order: StreamOrder | None = None,
    ):
        """``modes``: taken when the capture began (default: now). ``grad_sources``: the
        tensors besides the inputs whose ``requires_grad`` would give eager's outputs a
        gradient path (parameters, closure tensors); ``None`` for a recording that runs its own
        backward (a training step), which checks no gradients. ``copies``: the recording's
        copy-in nodes, set before each replay (``copy_nodes``). ``device``: the graph's (default:
        the current one). ``order``: shared by the graphs of one pool (their memory is shared
        too); by default this graph's own."""
        self.recording = graph  # the graph or segments themselves: only this class launches it
        self.copies = copies
        # Each graph is launched through a Launcher (launch.py); segments hold one per graph.
        if isinstance(graph, Segments):
            self.launchers = [graph.launcher(g) for g in graph.graphs]
            self._launch: Callable[[], None] = graph.replay
        else:
            self.launchers = [Launcher(graph, device)]
            self._launch = self.launchers[0]
        # What everyone else replays: on the static buffers as they are (copy nodes off).
        if copies is not None:
            self.graph = InputCopying(graph, copies, self._launch)
            self._launch_static = self.graph.replay
        else:
            self.graph = graph
            self._launch_static = self._launch
        self.name = name
        # With a timeout, each replay waits for the GPU (at most timeout_s) before returning.
        self.wait: Callable[[], None] | None = (
            functools.partial(wait_for_replay, timeout_s, name) if timeout_s else None
        )
        self.signature = signature
        self.counters = counters
        self.policy = policy
        self.output = output
        self._emitter = make_emitter(output, policy)
        self.emit: Callable[[], Any] = getattr(self._emitter, "emit", self._emitter)
        self.invalidate: Callable[[], None] | None = getattr(self._emitter, "invalidate", None)
        self.modes = modes if modes is not None else Modes(name)
        self.same_modes = self.modes.same
        self.grad_sources = tuple(grad_sources) if grad_sources is not None else ()
        # Captured with grad mode on (and outputs without a gradient path): every call checks
        # that no input or source requires grad that did not at capture. Captured under
        # no_grad, grad mode on is a mode change (modes.Modes.refuse).
        self.check_grad = grad_sources is not None and self.modes.seen["grad mode"] == "on"
        self.owner: int | None = None  # the thread of the calls so far
        self.order = order if order is not None else StreamOrder(device)
        self._stream = self.order.read
        self.shared = False  # a second thread called: outputs are copies from then on
        self.writeback = tuple((i, static[i]) for i in mutated)
        # Each mutated input with each other tensor input: a call must not pass them sharing
        # memory (eager's in-place write would show through the other one).
        self.alias_pairs = tuple(
            (i, j) for i in mutated for j in signature.tensor_index
            if j != i and (j not in mutated or j > i)
        )  # fmt: skip
        if mutated:
            log.info(
                "cudagraphs: the function mutates %s in place; replays copy the result back to "
                "the caller's tensors",
                ", ".join(signature.paths[i] for i in mutated),
            )
        node = {slot: k for k, slot in enumerate(copies.slots)} if copies is not None else {}
        self.slots = tuple(
            (i, x, x.data_ptr(), x.shape, x.dtype, x.get_device(), x.stride(), node.get(k, -1))
            for k, (i, x) in enumerate((i, static[i]) for i in signature.tensor_index)
        )
        # Plain values frozen at capture. The rule (signature.same_value): the same object, or the
        # same type and equal; ``1`` is not a captured ``True``.
        self.frozen = tuple(zip(signature.frozen_index, signature.frozen_values))
        self.flat = signature.is_flat  # positional leaves only: calls need no flattening
        self.n_args = signature.spec.num_leaves
        self.grad_at_capture = tuple(
            t.requires_grad for t in self._grad_tensors(static)
        ) if self.check_grad else ()  # fmt: skip

    def call(self, leaves: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The whole replay of a call (under the caller's lock): modes, gradients and thread
        (:meth:`enter`), each leaf checked against the capture and the tensors that are not
        in place copied, the replay, the previous outputs marked dead, write-back, outputs.

        Kept in one frame, since on a small graph the host's work before the launch adds to
        latency one for one: the common case (same modes, same thread) is decided inline and
        only a call with something to refuse or note takes :meth:`enter`; any doubt in the
        input check goes to the slow check, which explains.
        """
        if self.check_grad or _get_ident() != self.owner or not self.same_modes():
            self.enter(leaves)  # anything to check or refuse there: the slow path explains
        elif self._stream is not None and self._stream() != self.order.last:
            self.order.follow()
        dst: list[torch.Tensor] | None = None
        src: list[torch.Tensor] = []
        pointed: list[tuple[int, int]] = []  # (copy node, source address)
        try:
            for i, buf, ptr, shape, dtype, dev, stride, node in self.slots:
                x = leaves[i]
                if x is buf:
                    continue  # the static buffer itself: no copy
                if x.shape != shape or x.dtype is not dtype or x.get_device() != dev:
                    raise _Mismatch
                address = x.data_ptr()  # a stale output raises here
                if address == ptr and x.stride() == stride:
                    continue
                if node >= 0 and self.copies.takes(node, x, address):  # type: ignore[union-attr]
                    pointed.append((node, address))  # the graph copies it in
                    continue
                if dst is None:
                    dst = []
                dst.append(buf)
                src.append(x)
            for i, value in self.frozen:
                x = leaves[i]
                if x is not value and (type(x) is not type(value) or x != value):
                    raise _Mismatch
        except Exception:
            self.explain_mismatch(args, kwargs)
            raise
        if self.alias_pairs and _share_memory(leaves, self.alias_pairs):
            raise InputsAlias
        copied = len(pointed)
        if self.copies is not None:
            self.copies.apply(pointed)  # every other copy node off
        if dst is not None:
            # One multi-tensor kernel for several inputs: fewer launches in front of the replay.
            if len(dst) > 1:
                compat.foreach_copy(dst, src)
            else:
                dst[0].copy_(src[0])
            copied += len(dst)
        try:
            self._launch()
        finally:  # after the launch, so that this host work overlaps the GPU's (see _replay)
            if self.invalidate is not None:
                self.invalidate()
        if self.wait is not None:
            self.wait()
        counters = self.counters
        counters.replays += 1
        counters.copies += copied
        if self.writeback:
            self._write_back(leaves)
        return self.emit()

    def enter(self, leaves: Sequence[Any] = ()) -> None:
        """The checks that come before anything is written (for a caller that stages the
        static inputs itself before :meth:`replay_static`): modes, gradients, thread."""
        if not self.same_modes():
            self.modes.refuse(self._grad_tensors(leaves))  # raises, or accepts the new state
            self.same_modes = self.modes.same
        if self.check_grad:
            self._check_gradients(leaves)
        if _get_ident() != self.owner:
            self._from_thread()
        if self._stream is not None and self._stream() != self.order.last:
            self.order.follow()

    def _grad_tensors(self, leaves: Sequence[Any]) -> list[Any]:
        """The call's tensor inputs (``None`` each where the call has another arity, which the
        input check then refuses), then the gradient sources: aligned with the capture's."""
        if len(leaves) == self.n_args:
            inputs = [leaves[i] for i, *_ in self.slots]
        else:
            inputs = [None] * len(self.slots)
        return [*inputs, *self.grad_sources]

    def _check_gradients(self, leaves: Sequence[Any]) -> None:
        tensors = self._grad_tensors(leaves)
        if (why := newly_requiring_grad(tensors, self.grad_at_capture)) is not None:
            refuse_gradients(self.name, why)

    def _from_thread(self) -> None:
        """A call from a thread other than the one of the calls so far (or the first call)."""
        me = _get_ident()
        if self.owner is None:
            self.owner = me
            return
        if not self.shared:
            self.shared = True
            if self.policy == "guarded":
                self.emit = make_emitter(self.output, "clone")
                warnings.warn(
                    f"cudagraphs: {self.name} is called from a second thread; its outputs are "
                    "now copies made under the graph's lock, since a replay from one thread "
                    "would overwrite what another is reading. For zero-copy outputs across "
                    "threads capture with outputs='alias' and hold g.lock over each call and "
                    "every read of its outputs.",
                    CudaGraphsWarning,
                    stacklevel=user_stacklevel(),
                )
        in_use = getattr(self._emitter, "in_use", None)
        if in_use is not None and in_use():
            raise OutputsInUse

    def replay_static(self) -> Any:
        """Replay on whatever the static input buffers hold now; return the outputs. The
        caller ran :meth:`enter` before it wrote the buffers."""
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
            self._launch_static()
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
            compat.foreach_copy(back_dst, back_src)
            self.counters.writebacks += len(back_dst)

    def explain_mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise the precise error for a call the fast check refused."""
        _explain(self.signature, args, kwargs)


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
