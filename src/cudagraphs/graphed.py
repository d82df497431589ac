"""The graphed callable and its state machine.

::

    LAZY --first call--> (warm-up on a side stream -> capture) --> CAPTURED --call--> replay
      |                         | CaptureError, fallback="eager"
      |                         v
      +--no CUDA / CPU inputs--> EAGER (same signature checks, runs fn)

``Graphed.__call__`` on a captured graph is the hottest code in the project: everything it
needs is precomputed at capture, and positional-only calls skip pytree flattening.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import optree
import torch

from . import capture as _capture
from .errors import (
    CaptureError,
    ConfigError,
    CudaGraphsError,
    CudaGraphsWarning,
    StaleGraphError,
    VerificationError,
    explain,
)
from .guards import AddressGuard
from .options import Options
from .outputs import make_emitter
from .pool import Pool
from .stats import Stats
from .tree import NAMESPACE, Signature, flatten
from .verify import verify_against_eager

__all__ = ["Graphed", "State"]

log = logging.getLogger("cudagraphs")
R = TypeVar("R")

_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_capture_lock = threading.RLock()


class State(enum.Enum):
    LAZY = "lazy"  # waiting for the first call, whose arguments become the examples
    CAPTURED = "captured"  # replaying a recorded graph
    EAGER = "eager"  # pass-through: no CUDA, CPU inputs, or a failed capture with fallback


class _Mismatch(Exception):
    """Raised inside the fast check; the slow check then explains what differed."""


class Graphed(Generic[R]):
    """A function captured into a CUDA graph (or, without CUDA, run eagerly with the same checks).

    Create with :func:`cudagraphs.graph`. Call it like the function. Attributes:

    - ``state``: :class:`State` (``LAZY``, ``CAPTURED``, ``EAGER``)
    - ``inputs`` / ``input_kwargs``: the graph's static input buffers, arranged like the
      example call; ``g(*g.inputs, **g.input_kwargs)`` replays with no copy
    - ``stats``: a :class:`~cudagraphs.stats.Stats` snapshot
    - ``fallback_reason``: why it runs eagerly, or ``None``
    - ``pool``: the graph's memory pool handle, to share with another capture
    """

    def __init__(self, fn: Callable[..., R], options: Options):
        self.fn = fn
        self.options = options
        self.state = State.LAZY
        self.fallback_reason: str | None = None
        self.pool: Any = options.pool
        self.inputs: tuple[Any, ...] = ()
        self.input_kwargs: dict[str, Any] = {}
        self._signature: Signature | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        # Fast path state, all set at capture.
        self._flat = False  # positional leaves only: calls need no flattening
        self._frozen: tuple[tuple[int, Any], ...] = ()
        self._n_args = -1
        self._slots: tuple[tuple[int, torch.Tensor, int, torch.Size, torch.dtype, int], ...] = ()
        self._writeback: tuple[tuple[int, torch.Tensor], ...] = ()
        self._emit: Callable[[], Any] = _unset
        self._invalidate: Callable[[], None] | None = None
        self._guard: AddressGuard | None = None
        self._device: torch.device | None = None
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
        self._bound: weakref.WeakKeyDictionary[Any, Graphed[Any]] | None = None
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    # ------------------------------------------------------------------ calling

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        guard = self._guard
        if guard is not None and (reason := guard.stale()) is not None:
            self._on_stale(reason)
            return self(*args, **kwargs)  # recaptured: every precomputed field is new
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
        return self._replay(leaves, dst, src)

    def _replay(self, leaves: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> R:
        if dst:
            if len(dst) == 1:
                dst[0].copy_(src[0])
            else:
                torch._foreach_copy_(dst, src)
            self._copies += len(dst)
        invalidate = self._invalidate
        if invalidate is not None:
            invalidate()
        self._graph.replay()  # type: ignore[union-attr]
        self._calls += 1
        if self._writeback:
            self._write_back(leaves)
        return self._emit()

    def _replay_in_place(self) -> R:
        """Replay on whatever the static input buffers hold now (the caller filled them).

        For layers above this one (buckets) that have already checked and copied every input,
        and checked the guard (:meth:`_check_guard`) before copying.
        """
        invalidate = self._invalidate
        if invalidate is not None:
            invalidate()
        self._graph.replay()  # type: ignore[union-attr]
        self._calls += 1
        return self._emit()

    def _check_guard(self, guard: AddressGuard) -> bool:
        """Before a replay: recapture (True) or raise if a tensor read by address moved."""
        reason = guard.stale()
        if reason is None:
            return False
        self._on_stale(reason)
        return True

    def _on_stale(self, reason: str) -> None:
        """A guarded tensor moved: raise, or capture again on the current static inputs."""
        if self.options.on_stale == "raise":
            raise StaleGraphError(
                explain(
                    f"{_name(self.fn)}: {reason} since the graph was captured",
                    "the recording reads every tensor at the address it had at capture, so a "
                    "replay would silently compute with the old memory",
                    "update tensors in place (load_state_dict, param.copy_(...)) to keep the "
                    "graph, or pass on_stale='recapture' to capture again automatically",
                )
            )
        log.warning("cudagraphs: %s: %s; capturing again", _name(self.fn), reason)
        if self._invalidate is not None:
            self._invalidate()
        assert self._signature is not None and self._device is not None
        leaves, _ = optree.tree_flatten((self.inputs, self.input_kwargs), namespace=NAMESPACE)
        self._graph = None  # release the old recording before making the new one
        with torch.cuda.device(self._device):
            self._capture(self._signature, leaves, self._device)
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
            self._initialize(args, kwargs)
            return self._call_general(args, kwargs)
        if state is State.EAGER:
            assert self._signature is not None
            self._signature.check(args, kwargs)
            self._eager_calls += 1
            return self.fn(*args, **kwargs)
        leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
        assert self._signature is not None
        if spec != self._signature.spec:
            self._explain_mismatch(args, kwargs)
        return self._check_and_replay(leaves, args, kwargs)

    def _explain_mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise the precise error for a call the fast check refused."""
        assert self._signature is not None
        try:
            self._signature.check(args, kwargs)
        except CudaGraphsError as error:
            # Raised from inside the fast check's except block: drop that internal context.
            raise error from None
        # The fast check is stricter than nothing only where the slow one agrees; if they ever
        # disagree, refusing is the safe answer.
        raise AssertionError("cudagraphs: fast and slow signature checks disagree; please report")

    # ------------------------------------------------------------------ capture

    def _initialize(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Leave LAZY: capture on these example arguments, or become an eager pass-through."""
        signature, leaves = Signature.of_call(args, kwargs)
        self._signature = signature
        tensors = [leaves[i] for i in signature.tensor_index]
        paths = signature.tensor_paths()
        cuda = [t.device for t in tensors if _graphable(t)]
        other = [(p, t.device) for p, t in zip(paths, tensors) if not _graphable(t)]
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
        device = cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
        try:
            with torch.cuda.device(device):
                self._capture(signature, leaves, device)
        except CaptureError as error:
            _attach_findings(error, self.fn, args, kwargs)
            if self.options.fallback == "raise":
                raise
            self._become_eager(str(error), warn=False)

    def _become_eager(self, reason: str, *, warn: bool) -> None:
        self.state = State.EAGER
        self.fallback_reason = reason
        if warn:
            warnings.warn(
                f"cudagraphs: {reason}; {_name(self.fn)} runs eagerly (same signature checks, "
                "no graph). Graphs need CUDA tensors on a CUDA machine.",
                CudaGraphsWarning,
                stacklevel=_user_stacklevel(),
            )
        else:
            log.warning("cudagraphs: running %s eagerly: %s", _name(self.fn), reason)

    def _capture(self, signature: Signature, leaves: list[Any], device: torch.device) -> None:
        options = self.options
        # Static input buffers: clones of the examples, so the examples themselves are never
        # touched by warm-up. Normal (not inference) tensors, so in-place mutation by the
        # function shows in their version counters.
        with torch.inference_mode(False), torch.no_grad():
            static = list(leaves)
            for i in signature.tensor_index:
                static[i] = leaves[i].detach().clone()
        args, kwargs = optree.tree_unflatten(signature.spec, static)
        stream = options.stream or _default_capture_stream(device)
        with _capture_lock:
            self._warmup_s = _capture.warm_up(self.fn, args, kwargs, options.warmup, stream)
            versions = [static[i]._version for i in signature.tensor_index]
            shared = options.pool
            recording = _capture.capture(
                self.fn,
                args,
                kwargs,
                stream=stream,
                pool=shared.handle if isinstance(shared, Pool) else shared,
                capture_error_mode=options.capture_error_mode,
            )
            if isinstance(shared, Pool):
                shared.record(recording.pool_bytes)
        mutated = [
            i for i, before in zip(signature.tensor_index, versions) if static[i]._version != before
        ]
        self._graph = recording.graph
        self._capture_s = recording.capture_s
        self._pool_bytes = recording.pool_bytes
        self._static_input_bytes = sum(static[i].nbytes for i in signature.tensor_index)
        self.pool = recording.graph.pool()
        self.inputs, self.input_kwargs = args, kwargs

        output = _detach_outputs(recording.output, self.fn, warn=self._warn_grad_outputs)
        emitter = make_emitter(output, options.outputs)
        self._emit = emitter
        self._invalidate = getattr(emitter, "invalidate", None)
        self._writeback = tuple((i, static[i]) for i in mutated)
        if mutated:
            log.info(
                "cudagraphs: %s mutates %s in place; replays copy the result back to the "
                "caller's tensors",
                _name(self.fn),
                ", ".join(signature.paths[i] for i in mutated),
            )
        self._slots = tuple(
            (
                i,
                static[i],
                static[i].data_ptr(),
                static[i].shape,
                static[i].dtype,
                static[i].get_device(),
            )
            for i in signature.tensor_index
        )
        self._frozen = tuple(zip(signature.frozen_index, signature.frozen_values))
        self._flat = signature.is_flat
        self._n_args = signature.spec.num_leaves
        self._device = device
        self._guard = self._make_guard() if options.guard == "replay" else None
        self.state = State.CAPTURED
        if options.verify:
            try:
                verify_against_eager(self, options.verify)
            except VerificationError:
                # Never keep a graph that differs from eager: a later call captures (and
                # verifies) again rather than replaying this one.
                self.state, self._graph, self._guard, self._flat = State.LAZY, None, None, False
                raise

    # A training step returns its loss with grad history; a replay records none, so the
    # detach is expected there (TrainStep turns the warning off).
    _warn_grad_outputs = True

    def _make_guard(self) -> AddressGuard | None:
        guard = AddressGuard(self.fn, self.options.modules)
        return guard if guard.count else None

    # ------------------------------------------------------------------ the rest

    @property
    def stats(self) -> Stats:
        n_inputs = len(self._signature.tensor_index) if self._signature else 0
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
            guarded_tensors=self._guard.count if self._guard is not None else 0,
            guard_check=self._guard.addresses.backend if self._guard is not None else "",
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
        return f"<cudagraphs.Graphed {_name(self.fn)} state={self.state.value} outputs={self.options.outputs}>"


def _attach_findings(
    error: CaptureError, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Run the doctor on the failed function so the error shows the line, not only the code."""
    from .doctor import doctor

    try:
        report = doctor(fn, *args, **kwargs)
    except Exception as failure:  # the doctor must never hide the capture error itself
        log.debug("cudagraphs: doctor failed after a capture error: %s", failure)
        return
    error.findings = report.findings
    if report.findings:
        lines = [f"    - {f.kind} at {f.location}: {f.message}" for f in report.findings[:5]]
        error.args = (str(error) + "\n  cg.doctor found:\n" + "\n".join(lines),)


def _graphable(tensor: torch.Tensor) -> bool:
    """Whether a tensor can be a graph input. (One function, so that the CPU tests can run the
    captured path with a stand-in graph: tests/test_replay_path_cpu.py.)"""
    return tensor.is_cuda


def _unset() -> Any:  # pragma: no cover - replaced at capture
    raise AssertionError("not captured")


def _detach_outputs(output: Any, fn: Callable[..., Any], *, warn: bool) -> Any:
    """Detach tensor outputs once, at capture: a replay records no autograd history."""
    leaves, spec = flatten(output)
    if warn and any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        warnings.warn(
            f"cudagraphs: {_name(fn)} returns tensors that require grad, but a graph replay "
            "records no autograd history, so the outputs are detached. For inference wrap the "
            "capture in torch.no_grad() or torch.inference_mode().",
            CudaGraphsWarning,
            stacklevel=_user_stacklevel(),
        )
    return optree.tree_unflatten(
        spec, [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
    )


_default_capture_stream = _capture.default_stream  # a seam for the CPU stand-in tests


def _name(fn: Callable[..., Any]) -> str:
    return _capture._name(fn)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
        level += 1
    return level
