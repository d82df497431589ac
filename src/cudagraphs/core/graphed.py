"""The graphed callable and its state machine.

::

    cg.graph(fn, *examples):  warm-up on the examples (state restored) -> capture -> CAPTURED
    cg.graph(fn) / @cg.graph: LAZY --the first `warmup` calls: real, eager--> capture on the
                              next call, which is answered by its own replay -> CAPTURED
    CAPTURED --call--> check, copy-in, invalidate, replay, write-back, outputs
       |  guard: a tensor read by address moved -> capture again
    no CUDA / CPU inputs / failed capture with fallback="eager" -> EAGER (same checks, runs fn)

Every call runs the function exactly once (a replay or an eager call), and the library's own
runs (warm-up on the examples, recaptures) leave module buffers, caches and RNG states as they
found them (``side_effects``). Calls are serialized by a lock, so threads never mix results.

``Graphed.__call__`` on a captured graph is the hottest code in the project: everything it
needs is precomputed at capture, and positional-only calls skip pytree flattening.
"""

from __future__ import annotations

import enum
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import optree
import torch

from ..errors import (
    CaptureError,
    ConfigError,
    CudaGraphsError,
    CudaGraphsWarning,
    StaleGraphError,
    StateWriteError,
    VerificationError,
    explain,
)
from ..options import Options
from . import recorder
from .frames import callable_name, user_stacklevel
from .guards import AddressGuard
from .outputs import make_emitter
from .state import SideEffects
from .stats import Stats
from .tree import NAMESPACE, Signature, flatten

__all__ = ["Diagnostics", "Graphed", "State", "install_diagnostics"]

log = logging.getLogger("cudagraphs")
R = TypeVar("R")

_capture_lock = threading.RLock()  # one capture at a time per process: captures share streams


class State(enum.Enum):
    LAZY = "lazy"  # waiting for calls: the first `warmup` run eagerly, the next captures
    CAPTURED = "captured"  # replaying a recorded graph
    EAGER = "eager"  # pass-through: no CUDA, CPU inputs, or a failed capture with fallback


class Diagnostics:
    """What the core asks of the diagnostics layer, which the API layer installs.

    The core never imports the doctor or the verifier; :func:`install_diagnostics` hands it an
    object with these two methods (the defaults do nothing).
    """

    def verify(self, graphed: Graphed[Any], rounds: int) -> None:
        """Raise :class:`VerificationError` if the new graph differs from eager."""

    def explain_capture_error(
        self, error: CaptureError, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        """Add what the doctor finds to a capture error's message."""


_diagnostics = Diagnostics()


def install_diagnostics(diagnostics: Diagnostics) -> None:
    """Called once by the API layer: verification and capture-error findings for every graph."""
    global _diagnostics
    _diagnostics = diagnostics


class _Mismatch(Exception):
    """Raised inside the fast check; the slow check then explains what differed."""


class Graphed(Generic[R]):
    """A function captured into a CUDA graph (or, without CUDA, run eagerly with the same checks).

    Create with :func:`cudagraphs.graph`. Call it like the function. Attributes:

    - ``state``: :class:`State` (``LAZY``, ``CAPTURED``, ``EAGER``)
    - ``inputs`` / ``input_kwargs``: the graph's static input buffers, arranged like the
      example call; ``g(*g.inputs, **g.input_kwargs)`` replays with no copy
    - ``stats``: a :class:`~cudagraphs.Stats` snapshot
    - ``fallback_reason``: why it runs eagerly, or ``None``
    - ``pool``: the graph's memory pool handle, to share with another capture
    - ``state_writes``: names of the tensors outside the inputs that the function writes (each
      replay repeats those writes; warm-up's were put back)
    """

    # A training step returns its loss with grad history; a replay records none, so the
    # detach is expected there (TrainStep turns the warning off).
    warn_grad_outputs = True

    def __init__(self, fn: Callable[..., R], options: Options):
        self.fn = fn
        self.options = options
        self.state = State.LAZY
        self.fallback_reason: str | None = None
        self.pool: Any = options.pool
        self.inputs: tuple[Any, ...] = ()
        self.input_kwargs: dict[str, Any] = {}
        self.signature: Signature | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.guard: AddressGuard | None = None
        self.mutated_inputs: tuple[int, ...] = ()  # leaf indices the function writes in place
        self.state_writes: list[str] = []
        self.device: torch.device | None = None
        self.eager_warmups_left = options.warmup  # lazy form: real calls before the capture
        self.lock = threading.RLock()
        # Fast path state, all set at capture.
        self._flat = False  # positional leaves only: calls need no flattening
        self._frozen: tuple[tuple[int, Any], ...] = ()
        self._n_args = -1
        self._slots: tuple[tuple[int, torch.Tensor, int, torch.Size, torch.dtype, int], ...] = ()
        self._writeback: tuple[tuple[int, torch.Tensor], ...] = ()
        self._emit: Callable[[], Any] = _unset
        self._invalidate: Callable[[], None] | None = None
        # Counters.
        self._calls = 0
        self._eager_calls = 0
        self._copies = 0
        self._writebacks = 0
        self._warmup_s = 0.0
        self._capture_s = 0.0
        self._pool_bytes = 0
        self._static_input_bytes = 0
        self._recaptures = 0
        self._restored_bytes = 0
        self._bound: weakref.WeakKeyDictionary[Any, Graphed[Any]] | None = None
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    # ------------------------------------------------------------------ calling

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        with self.lock:
            guard = self.guard
            if guard is not None and (reason := guard.stale()) is not None:
                self._on_stale(reason)
            if not self._flat or kwargs or len(args) != self._n_args:
                return self._call_general(args, kwargs)
            return self._check_and_replay(args, args, kwargs)  # positional leaves: no flattening

    def _check_and_replay(self, leaves: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """Check each leaf against the capture, copy the tensors that need it, replay.

        The check is a flat loop over what capture precomputed; any doubt (a non-tensor, a
        stale output, a value that compares oddly) goes to the slow check, which explains.
        """
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        try:
            for i, buf, ptr, shape, dtype, dev in self._slots:
                x = leaves[i]
                if x is buf:
                    continue
                if x.shape != shape or x.dtype != dtype or x.get_device() != dev:
                    raise _Mismatch
                if x.data_ptr() == ptr and x.stride() == buf.stride():
                    continue
                dst.append(buf)
                src.append(x)
            for i, value in self._frozen:
                x = leaves[i]
                if x is not value and (type(x) is not type(value) or x != value):
                    raise _Mismatch
        except Exception:
            self._explain_mismatch(args, kwargs)
            raise
        if dst:
            if len(dst) == 1:
                dst[0].copy_(src[0])
            else:
                torch._foreach_copy_(dst, src)
            self._copies += len(dst)
        out = self.replay_static()
        if self._writeback:
            self._write_back(leaves)
        return out

    def replay_static(self) -> R:
        """Replay on whatever the static input buffers hold now, and return the outputs.

        The one replay step (invalidate the last outputs, launch, emit) that every caller
        shares: this class's own calls, and layers above (buckets) that checked and copied
        their inputs themselves and called :meth:`refresh` first. Hold ``lock`` around both.
        """
        invalidate = self._invalidate
        if invalidate is not None:
            invalidate()
        self.graph.replay()  # type: ignore[union-attr]
        self._calls += 1
        return self._emit()

    def refresh(self) -> bool:
        """Before a replay driven from above: capture again if a tensor read by address moved
        (or raise, with ``on_stale="raise"``). True when a new capture replaced the graph (its
        static buffers are new)."""
        guard = self.guard
        if guard is None or (reason := guard.stale()) is None:
            return False
        self._on_stale(reason)
        return True

    def _on_stale(self, reason: str) -> None:
        """A guarded tensor moved: raise, or capture again on the current static inputs."""
        if self.options.on_stale == "raise":
            raise StaleGraphError(
                explain(
                    f"{callable_name(self.fn)}: {reason} since the graph was captured",
                    "the recording reads every tensor at the address it had at capture, so a "
                    "replay would silently compute with the old memory",
                    "update tensors in place (load_state_dict, param.copy_(...)) to keep the "
                    "graph, or pass on_stale='recapture' to capture again automatically",
                )
            )
        log.warning("cudagraphs: %s: %s; capturing again", callable_name(self.fn), reason)
        if self._invalidate is not None:
            self._invalidate()
        assert self.signature is not None and self.device is not None
        leaves, _ = optree.tree_flatten((self.inputs, self.input_kwargs), namespace=NAMESPACE)
        self.graph = None  # release the old recording before making the new one
        with torch.cuda.device(self.device):
            self._capture(self.signature, leaves, self.device, warmup=self.recapture_warmup)
        self._recaptures += 1

    def _write_back(self, leaves: Any) -> None:
        # The function mutated these inputs in place; eager would have mutated the caller's
        # tensors, so copy the graph's result back unless the caller passed the buffer itself.
        back_dst = []
        back_src = []
        for i, buf in self._writeback:
            if leaves[i] is not buf:
                back_dst.append(leaves[i])
                back_src.append(buf)
        if back_dst:
            torch._foreach_copy_(back_dst, back_src)
            self._writebacks += len(back_dst)

    def _call_general(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        state = self.state
        if state is State.LAZY:
            if self.signature is None:
                self._classify(args, kwargs)
                if self.state is State.EAGER:
                    return self._call_general(args, kwargs)
            else:
                self.signature.check(args, kwargs)
            if self.eager_warmups_left > 0:
                self.eager_warmups_left -= 1
                return self.eager_warmup_call(args, kwargs)
            self.initialize(args, kwargs, warmup=0)
            return self._call_general(args, kwargs)
        if state is State.EAGER:
            assert self.signature is not None
            self.signature.check(args, kwargs)
            self._eager_calls += 1
            return self.fn(*args, **kwargs)
        leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
        assert self.signature is not None
        if spec != self.signature.spec:
            self._explain_mismatch(args, kwargs)
        return self._check_and_replay(leaves, args, kwargs)

    def eager_warmup_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """One of the lazy form's warm-up calls: the caller's real call, run eagerly on the
        capture stream (allocator, cuBLAS handles and autotuning settle outside the recording),
        answered with its own result. It counts: N calls are N executions."""
        assert self.device is not None
        stream = self.options.stream or recorder.default_stream(self.device)
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), recorder.uncached_autocast():
            output = self.fn(*args, **kwargs)
        current.wait_stream(stream)
        self._eager_calls += 1
        return self.prepare_eager_output(output)

    def prepare_eager_output(self, output: Any) -> Any:
        """What an eager call hands back (a training step detaches its loss here)."""
        return output

    def _explain_mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise the precise error for a call the fast check refused."""
        assert self.signature is not None
        try:
            self.signature.check(args, kwargs)
        except CudaGraphsError as error:
            # Raised from inside the fast check's except block: drop that internal context.
            raise error from None
        # The fast check is stricter than nothing only where the slow one agrees; if they ever
        # disagree, refusing is the safe answer.
        raise AssertionError("cudagraphs: fast and slow signature checks disagree; please report")

    # ------------------------------------------------------------------ capture

    def initialize(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: int | None = None
    ) -> None:
        """Leave LAZY: capture on these example arguments, or become an eager pass-through.

        ``warmup`` eager runs on clones of the examples come first (default: the option), and
        what they write outside the inputs is put back (``side_effects``).
        """
        with self.lock:
            if self.signature is None:
                self._classify(args, kwargs)
            if self.state is State.EAGER:
                return
            assert self.signature is not None and self.device is not None
            _, leaves = Signature.of_call(args, kwargs)
            try:
                with torch.cuda.device(self.device):
                    self._capture(
                        self.signature,
                        leaves,
                        self.device,
                        warmup=self.options.warmup if warmup is None else warmup,
                    )
            except CaptureError as error:
                _diagnostics.explain_capture_error(error, self.fn, args, kwargs)
                if self.options.fallback == "raise":
                    raise
                self._become_eager(str(error), warn=False)

    def _classify(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The first call's signature and device: graphable on one CUDA device, or eager."""
        signature, leaves = Signature.of_call(args, kwargs)
        self.signature = signature
        tensors = [leaves[i] for i in signature.tensor_index]
        paths = signature.tensor_paths()
        cuda = [t.device for t in tensors if recorder.graphable(t)]
        other = [(p, t.device) for p, t in zip(paths, tensors) if not recorder.graphable(t)]
        if cuda and other:
            path, device = other[0]
            raise ConfigError(
                explain(
                    f"{path} is on {device} while other inputs are on {cuda[0]}",
                    "a CUDA graph can only read CUDA memory; a CPU input would be frozen at capture",
                    f"move {path} to {cuda[0]} before calling",
                )
            )
        if len(set(cuda)) > 1:
            raise ConfigError(
                explain(
                    f"the inputs are on several CUDA devices: {sorted(set(map(str, cuda)))}",
                    "one graph is recorded on one device",
                    "move the inputs to one device, or capture one graph per device",
                )
            )
        reason = None
        if not torch.cuda.is_available():
            reason = "CUDA is not available"
        elif other:
            reason = f"the inputs are on {other[0][1]}, not CUDA"
        if reason is not None:
            # Buffers of the example's layout so that g(*g.inputs) also works without CUDA.
            self.inputs, self.input_kwargs = optree.tree_unflatten(
                signature.spec,
                [
                    leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
                    for leaf in leaves
                ],
            )
            self._become_eager(reason, warn=True)
            return
        self.device = cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())

    def _become_eager(self, reason: str, *, warn: bool) -> None:
        self.state = State.EAGER
        self.fallback_reason = reason
        if warn:  # once per graphed callable: the first call that finds it cannot graph
            warnings.warn(
                f"cudagraphs: {reason}; {callable_name(self.fn)} runs eagerly (same signature "
                "checks, no graph). Graphs need CUDA tensors on a CUDA machine.",
                CudaGraphsWarning,
                stacklevel=user_stacklevel(),
            )
        else:
            log.warning("cudagraphs: running %s eagerly: %s", callable_name(self.fn), reason)

    def before_capture(self) -> None:
        """Called right before each capture (a training step resets gradients here)."""

    @property
    def recapture_warmup(self) -> int:
        """Warm-up runs before a capture redone because a guarded tensor moved."""
        return self.options.warmup

    def _capture(
        self, signature: Signature, leaves: list[Any], device: torch.device, *, warmup: int
    ) -> None:
        options = self.options
        self.before_capture()
        # Static input buffers: clones of the examples, so the examples themselves are never
        # touched by warm-up. Normal (not inference) tensors, so in-place mutation by the
        # function shows in their version counters.
        with torch.inference_mode(False), torch.no_grad():
            static = list(leaves)
            for i in signature.tensor_index:
                static[i] = leaves[i].detach().clone()
        args, kwargs = optree.tree_unflatten(signature.spec, static)
        stream = options.stream or recorder.default_stream(device)
        inputs = [static[i] for i in signature.tensor_index]
        with _capture_lock:
            effects = SideEffects(
                self.fn,
                inputs,
                [static[i] for i in signature.frozen_index],
                options.side_effects if warmup else "keep",
            )
            with effects.running():
                self._warmup_s = recorder.warm_up(self.fn, args, kwargs, warmup, stream)
            written = effects.finish()
            self._report_side_effects(effects)
            versions = [x._version for x in inputs]
            shared = options.pool
            recording = recorder.capture(
                self.fn,
                args,
                kwargs,
                stream=stream,
                pool=shared.handle if hasattr(type(shared), "handle") else shared,
                capture_error_mode=options.capture_error_mode,
            )
            if hasattr(type(shared), "record"):
                shared.record(recording.pool_bytes)
        mutated = [
            i
            for i, x, before in zip(signature.tensor_index, inputs, versions)
            if x._version != before
        ]
        if written.names:
            self.state_writes = written.names
        self.graph = recording.graph
        self._capture_s = recording.capture_s
        self._pool_bytes = recording.pool_bytes
        self._static_input_bytes = sum(x.nbytes for x in inputs)
        self.pool = recording.graph.pool()
        self.inputs, self.input_kwargs = args, kwargs

        output = _detach_outputs(recording.output, self.fn, warn=self.warn_grad_outputs)
        emitter = make_emitter(output, options.outputs)
        self._emit = emitter
        self._invalidate = getattr(emitter, "invalidate", None)
        self.mutated_inputs = tuple(mutated)
        self._writeback = tuple((i, static[i]) for i in mutated)
        if mutated:
            log.info(
                "cudagraphs: %s mutates %s in place; replays copy the result back to the "
                "caller's tensors",
                callable_name(self.fn),
                ", ".join(signature.paths[i] for i in mutated),
            )
        self._slots = tuple(
            (i, x, x.data_ptr(), x.shape, x.dtype, x.get_device())
            for i, x in zip(signature.tensor_index, inputs)
        )
        self._frozen = tuple(zip(signature.frozen_index, signature.frozen_values))
        self._flat = signature.is_flat
        self._n_args = signature.spec.num_leaves
        self.device = device
        self.guard = self.make_guard() if options.guard == "replay" else None
        self.state = State.CAPTURED
        if options.verify:
            try:
                _diagnostics.verify(self, options.verify)
            except VerificationError:
                # Never keep a graph that differs from eager: a later call captures (and
                # verifies) again rather than replaying this one.
                self.state, self.graph, self.guard, self._flat = State.LAZY, None, None, False
                self.eager_warmups_left = 0
                raise

    def _report_side_effects(self, effects: SideEffects) -> None:
        written = effects.written
        name = callable_name(self.fn)
        if effects.unrestored:
            _warn_once(
                f"cudagraphs: warm-up of {name} changed {', '.join(effects.unrestored[:5])}, which "
                "could not be put back (written from compiled code that cudagraphs could not "
                "copy first); capture lazily (cg.graph(fn) without examples) so warm-up calls are "
                "your real calls, or pass side_effects='keep' to accept it"
            )
        if not written.names:
            return
        self._restored_bytes += written.nbytes
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

    def make_guard(self) -> AddressGuard | None:
        """The address guard checked before each replay (None when nothing is read by address)."""
        guard = AddressGuard(self.fn, self.options.modules)
        return guard if guard.count else None

    # ------------------------------------------------------------------ the rest

    @property
    def stats(self) -> Stats:
        n_inputs = len(self.signature.tensor_index) if self.signature else 0
        return Stats(
            state=self.state.value,
            calls=self._calls + self._eager_calls,
            replays=self._calls,
            eager_calls=self._eager_calls,
            copies=self._copies,
            copies_skipped=self._calls * n_inputs - self._copies,
            writebacks=self._writebacks,
            warmup_s=self._warmup_s,
            capture_s=self._capture_s,
            pool_bytes=self._pool_bytes,
            static_input_bytes=self._static_input_bytes,
            recaptures=self._recaptures,
            guarded_tensors=self.guard.count if self.guard is not None else 0,
            guard_check=self.guard.addresses.backend if self.guard is not None else "",
            state_writes=len(self.state_writes),
            restored_bytes=self._restored_bytes,
        )

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """``@cg.graph`` on a method: one graph per instance, bound to it."""
        if instance is None:
            return self
        if self._bound is None:
            self._bound = weakref.WeakKeyDictionary()
        bound = self._bound.get(instance)
        if bound is None:
            bound = Graphed(self.fn.__get__(instance, owner), self.options)  # type: ignore[attr-defined]
            self._bound[instance] = bound
        return bound

    def __repr__(self) -> str:
        return (
            f"<cudagraphs.Graphed {callable_name(self.fn)} state={self.state.value} "
            f"outputs={self.options.outputs}>"
        )


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A :class:`CudaGraphsWarning` shown once per process and message, at the user's line."""
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, CudaGraphsWarning, stacklevel=user_stacklevel())


def _unset() -> Any:  # pragma: no cover - replaced at capture
    raise AssertionError("not captured")


def _detach_outputs(output: Any, fn: Callable[..., Any], *, warn: bool) -> Any:
    """Detach tensor outputs once, at capture: a replay records no autograd history."""
    leaves, spec = flatten(output)
    if warn and any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        _warn_once(
            f"cudagraphs: {callable_name(fn)} returns tensors that require grad, but a graph "
            "replay records no autograd history, so the outputs are detached. For inference wrap "
            "the capture in torch.no_grad() or torch.inference_mode()."
        )
    return optree.tree_unflatten(
        spec, [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
    )
