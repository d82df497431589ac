"""The graphed callable and its state machine.

::

    LAZY --first call (or cg.graph's examples): its signature and device-->
        WARMING_UP                      on one CUDA device
        EAGER                           no CUDA, CPU inputs (same checks, runs fn)
    WARMING_UP --call, `warmups_left` > 0: the caller's call, run eagerly--> WARMING_UP
    WARMING_UP --next call: capture (the examples form warms up on clones first)-->
        CAPTURED                        the call is answered by its own replay
        EAGER                           the capture failed and fallback="eager"
        WARMING_UP                      the new graph differs from eager (verify): raised
    CAPTURED --call, guard holds--> replay: check, copy-in, launch, outputs
    CAPTURED --call, a tensor read by address moved or a Python value read changed-->
        CAPTURED                        captured again on the static inputs (recapture)
        (StaleGraphError)               on_stale="raise": refused, the graph kept

:meth:`Graphed.__call__` is the whole machine: the guard and the fast replay, then
:meth:`Graphed._dispatch` by state, each transition one named method below it.

Every call runs the function exactly once (a replay or an eager call), and the library's own
runs (warm-up on the examples, recaptures) leave module buffers, caches and RNG states as they
found them (:mod:`~cudagraphs.core.writes`). Calls are serialized by a lock, so threads never
mix results.

``Graphed.__call__`` on a captured graph is the hottest code in the project: the guard is one C
call, everything else it needs was precomputed at capture, and a call of positional leaves goes
straight to :meth:`~cudagraphs.core.replay.Replayer.call` without pytree flattening.

A failed capture's findings and a new graph's verification come from the diagnostics layer,
through :mod:`~cudagraphs.core.diagnostics` (the core never imports that layer).
"""

from __future__ import annotations

import enum
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import optree
import torch

from ..errors import CaptureError, Notices, StaleGraphError, VerificationError, explain
from ..options import Options
from . import capture
from .capture import Captured
from .diagnostics import installed
from .frames import callable_name, user_stacklevel
from .guards import AddressGuard, closure_tensors, modules_of
from .modes import outputs_needing_gradients, refuse_gradients
from .python_values import ValueWatch, retrace_after_untraced_change
from .replay import Counters, InputsAlias, OutputsInUse, Replayer
from .segments import describe_segments, print_segments
from .signature import NAMESPACE, Signature
from .stats import Costs, Stats, snapshot

__all__ = ["Graphed", "State"]

log = logging.getLogger("cudagraphs")
R = TypeVar("R")
_NO_KWARGS: dict[str, Any] = {}  # read only: what a positional call's explanation is given


class State(enum.Enum):
    LAZY = "lazy"  # no call yet: the first one's signature and device decide
    WARMING_UP = "warming up"  # the next `warmups_left` calls run eagerly, the one after captures
    CAPTURED = "captured"  # replaying a recorded graph
    EAGER = "eager"  # pass-through: no CUDA, CPU inputs, or a failed capture with fallback


class Graphed(Generic[R]):
    """A function captured into a CUDA graph (or, without CUDA, run eagerly with the same checks).

    Create with :func:`cudagraphs.graph`. Call it like the function. Attributes:

    - ``state``: :class:`State` (``LAZY``, ``WARMING_UP``, ``CAPTURED``, ``EAGER``)
    - ``inputs`` / ``input_kwargs``: the graph's static input buffers, arranged like the
      example call; ``g(*g.inputs, **g.input_kwargs)`` replays with no copy
    - ``stats``: a :class:`~cudagraphs.Stats` snapshot
    - ``fallback_reason``: why it runs eagerly, or ``None``
    - ``pool``: the graph's memory pool handle, to share with another capture
    - ``state_writes``: names of the tensors outside the inputs that the function writes (each
      replay repeats those writes; warm-up's were put back)
    - ``warmup`` / ``warmups_left``: eager runs before a capture; the lazy form spends them on
      the caller's first calls
    """

    # True for a training step (TrainStep): its recording runs its own backward.
    records_gradients = False
    # False for a training step (its warm-up runs would be optimizer steps), and for any step
    # whose every run advances state it owns (an LLM engine's decode step): the recapture
    # records without running it, and the call's replay is its one run.
    recapture_warms_up = True

    def __init__(self, fn: Callable[..., R], options: Options):
        self.fn = fn
        self.options = options
        self.state = State.LAZY
        self.fallback_reason: str | None = None
        self.pool: Any = options.pool
        self.signature: Signature | None = None
        # What the current capture made, kept whole (None before capture or when eager), and
        # its replay path, which the hot path reads.
        self.captured: Captured | None = None
        self.replayer: Replayer | None = None
        self._eager_inputs: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
        # Checked before each replay (None: nothing read by address, no Python value read).
        self.guard: AddressGuard | None = None
        self._grad_sources: list[torch.Tensor] | None = None  # see gradient_sources()
        self.state_writes: list[str] = []
        self.device: torch.device | None = None
        self.warmup = options.warmup
        self.warmups_left = options.warmup
        # Re-entrant: a server clones an output under it (`with g.lock: y = g(x).clone()`).
        self.lock = threading.RLock()
        self._adopt_inputs = False
        self._counters = Counters()
        self._costs = Costs()
        # Warnings once per cause (shared with the other graphs of a cg.Pool); counted in stats.
        self.notices: Notices = getattr(options.pool, "notices", None) or Notices()
        self._bound: weakref.WeakKeyDictionary[Any, Graphed[Any]] | None = None
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    # -- the state machine ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        with self.lock:
            try:
                guard = self.guard
                if guard is not None and not guard.check() and (reason := guard.stale()):
                    self._when_stale(reason)  # the common answer, check(), is one C call
                replayer = self.replayer
                if (
                    replayer is not None
                    and replayer.flat
                    and len(args) == replayer.n_args
                    and not kwargs
                ):
                    return replayer.call(args, args, _NO_KWARGS)  # positional: no flattening
                return self._dispatch(args, kwargs)
            except InputsAlias:
                self._warn_inputs_alias()
                return self.answer_eagerly(args, kwargs)
            except OutputsInUse:
                return self.answer_eagerly(args, kwargs)

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """One call by state (the guard was checked by the caller)."""
        state = self.state
        if state is State.LAZY:
            self._classify(args, kwargs)  # -> WARMING_UP or EAGER
            return self._dispatch(args, kwargs)
        if state is State.WARMING_UP:
            assert self.signature is not None
            self.signature.check(args, kwargs)
            if self.warmups_left > 0:
                self.warmups_left -= 1
                return self.eager_warmup_call(args, kwargs)
            self.initialize(args, kwargs, warmup=0)  # the real calls were the warm-up
            return self._dispatch(args, kwargs)
        if state is State.EAGER:
            return self._eager_call(args, kwargs)
        return self._replay(args, kwargs)

    def _replay(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """CAPTURED, a call the fast path did not take (keywords, a pytree of arguments)."""
        leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
        replayer = self.replayer
        assert replayer is not None
        if spec != replayer.signature.spec:
            replayer.explain_mismatch(args, kwargs)
        return replayer.call(leaves, args, kwargs)

    def _eager_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """EAGER: the pass-through, with the signature checks a graph makes."""
        assert self.signature is not None
        self.signature.check(args, kwargs)
        self._costs.eager_calls += 1
        return self.check_output_gradients(self.fn(*args, **kwargs))

    def initialize(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        warmup: int | None = None,
        adopt_inputs: bool = False,
    ) -> None:
        """Leave LAZY (or WARMING_UP): capture on these example arguments, or become an
        eager pass-through.

        ``warmup`` eager runs on clones of the examples come first (default: ``self.warmup``),
        and what they write outside the inputs is put back. ``adopt_inputs``: the example
        tensors themselves become the static inputs (a layer above owns them, as buckets own
        views of one buffer) instead of clones.
        """
        with self.lock:
            self._adopt_inputs = adopt_inputs
            if self.state is State.LAZY:
                self._classify(args, kwargs)
            if self.state is State.EAGER:
                return
            _, leaves = Signature.of_call(args, kwargs)
            try:
                self._capture(leaves, warmup=self.warmup if warmup is None else warmup)
            except CaptureError as error:
                installed().explain_capture_error(error, self.fn, args, kwargs)
                if self.options.fallback == "raise":
                    raise
                self._fall_back_to_eager(str(error), warn=False)

    def _classify(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """LAZY -> WARMING_UP on one CUDA device, or EAGER: the first call's signature."""
        signature, leaves = Signature.of_call(args, kwargs)
        self.signature = signature
        tensors = [leaves[i] for i in signature.tensor_index]
        placed = capture.place(signature.tensor_paths(), tensors)
        if isinstance(placed, str):
            # Buffers of the example's layout so that g(*g.inputs) also works without CUDA.
            self._eager_inputs = optree.tree_unflatten(
                signature.spec,
                [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves],
            )
            self._fall_back_to_eager(placed, warn=True)
            return
        self.device = placed
        self.state = State.WARMING_UP

    def _capture(self, leaves: list[Any], *, warmup: int) -> None:
        """-> CAPTURED: a :class:`~cudagraphs.core.capture.Capture` run; a graph that fails its
        verification is dropped (-> WARMING_UP, with nothing left to warm up)."""
        assert self.signature is not None and self.device is not None
        self.before_capture()
        with torch.cuda.device(self.device):
            made = capture.Capture(
                self.fn, self.signature, self.options, device=self.device,
                counters=self._counters, adopt_inputs=self._adopt_inputs,
                grad_sources=None if self.records_gradients else self.gradient_sources(),
            ).run(leaves, warmup=warmup, settled=not warmup and self.warmups_left < self.warmup)  # fmt: skip
        self._costs.record_capture(made)
        self.captured = made
        self.replayer = made.replayer  # the hot path's one read
        self.pool = made.recording.graph.pool()
        if made.written.names:
            self.state_writes = made.written.names
        self.guard = self.make_guard() if self.options.guard == "replay" else None
        self.state = State.CAPTURED
        if self.options.verify:
            try:
                installed().verify(self, self.options.verify)
            except VerificationError:
                self._drop_unverified()
                raise

    def _drop_unverified(self) -> None:
        """CAPTURED -> WARMING_UP: never keep a graph that differs from eager; the next call
        captures (and verifies) again rather than replaying this one."""
        self.state, self.captured, self.replayer, self.guard = State.WARMING_UP, None, None, None
        self.pool = self.options.pool  # that pool went with its graph
        self.warmups_left = 0

    def _when_stale(self, reason: str) -> None:
        """A guarded tensor moved or a read value changed: refuse or recapture."""
        if self.options.on_stale == "raise":
            self._refuse_stale(reason)
        self._recapture(reason)

    def _refuse_stale(self, reason: str) -> None:
        raise StaleGraphError(
            explain(
                f"{callable_name(self.fn)}: {reason} since the graph was captured",
                "the recording reads every tensor at the address it had at capture, and "
                "every Python value as it was then, so a replay would silently compute "
                "with the old ones",
                "update tensors in place (load_state_dict, param.copy_(...)) and leave the "
                "values alone to keep the graph, or pass on_stale='recapture' to capture "
                "again automatically",
            )
        )

    def _recapture(self, reason: str) -> None:
        """CAPTURED -> CAPTURED: capture again on the current static inputs."""
        self.notices.warn(
            f"capturing again: {_cause(reason)}",
            f"cudagraphs: {callable_name(self.fn)}: {reason}; capturing again (shown once; "
            "stats.notices counts each time)",
            logger=log,
        )
        for watch in [*self.value_watches(), *([self.guard] if self.guard else [])]:
            retrace_after_untraced_change(self.fn, watch)
        old = self.replayer
        assert old is not None
        old.release_outputs()
        leaves, _ = optree.tree_flatten((self.inputs, self.input_kwargs), namespace=NAMESPACE)
        self.replayer = None
        # The old recording lives until the new one is made: it holds the memory pool, which
        # the new capture reuses; a pool whose last graph is gone cannot be captured into.
        self._capture(leaves, warmup=self.warmup if self.recapture_warms_up else 0)
        del old
        self._costs.recaptures += 1

    def _fall_back_to_eager(self, reason: str, *, warn: bool) -> None:
        """-> EAGER: no CUDA or CPU inputs (``warn``), or a failed capture (logged)."""
        self.state = State.EAGER
        self.fallback_reason = reason
        if warn:  # once per cause, for all the graphs of a pool (a decoder's rungs)
            self.notices.warn(
                f"runs eagerly: {reason}",
                f"cudagraphs: {reason}; {callable_name(self.fn)} runs eagerly (same signature "
                "checks, no graph). Graphs need CUDA tensors on a CUDA machine.",
                stacklevel=user_stacklevel(),
            )
        else:
            log.warning("cudagraphs: running %s eagerly: %s", callable_name(self.fn), reason)

    def _warn_inputs_alias(self) -> None:
        self.notices.warn(
            "answered eagerly: inputs share memory",
            f"cudagraphs: {callable_name(self.fn)} was called with an input it writes "
            "in place sharing memory with another input; a replay reads them from "
            "separate buffers, so this call runs eagerly (shown once; stats.notices "
            "counts each time). Pass separate tensors to replay.",
            logger=log,
        )

    # -- what the current capture made ------------------------------------------------------

    @property
    def inputs(self) -> tuple[Any, ...]:
        """The static input buffers, arranged like the example call's positional arguments."""
        return self.captured.inputs if self.captured is not None else self._eager_inputs[0]

    @property
    def input_kwargs(self) -> dict[str, Any]:
        """The static input buffers of the example call's keyword arguments."""
        return self.captured.input_kwargs if self.captured is not None else self._eager_inputs[1]

    @property
    def mutated_inputs(self) -> tuple[int, ...]:
        """Leaf indices of the inputs the function writes in place."""
        return self.captured.mutated if self.captured is not None else ()

    @property
    def read_values(self) -> list[tuple[str, Any, str, Any]]:
        """The plain Python values the recording read (see ``python_values.py``)."""
        return self.captured.values if self.captured is not None else []

    # -- for the layers above (buckets, training steps) -----------------------------------

    @property
    def graph(self) -> Any:
        """The captured ``torch.cuda.CUDAGraph`` or :class:`~cudagraphs.core.segments.Segments`
        (``None`` before capture or when eager); ``replay()`` replays on what ``inputs`` hold."""
        return self.replayer.graph if self.replayer is not None else None

    def enter_replay(self, leaves: Sequence[Any]) -> None:
        """Before a layer above (buckets) writes the static inputs: the checks every replay
        makes first (modes, gradients, thread; ``replay.OutputsInUse`` means: answer this
        call eagerly). Then :meth:`replay_static`. Hold ``lock`` around all of it."""
        self.replayer.enter(leaves)  # type: ignore[union-attr]

    def replay_static(self) -> R:
        """Replay on whatever the static input buffers hold now, and return the outputs: for
        layers above (buckets) that checked and copied their inputs themselves and called
        :meth:`refresh` and :meth:`enter_replay` first. Hold ``lock`` around all of it."""
        return self.replayer.replay_static()  # type: ignore[union-attr]

    def gradient_sources(self) -> list[torch.Tensor]:
        """The tensors besides the inputs that give eager's outputs a gradient path when they
        require grad: the parameters of the modules ``fn`` uses and its closure tensors."""
        if self._grad_sources is None:
            sources = [p for m in modules_of(self.fn, self.options.modules) for p in m.parameters()]
            sources += [t for _, _, t in closure_tensors(self.fn) if isinstance(t, torch.Tensor)]
            self._grad_sources = sources
        return self._grad_sources

    def check_output_gradients(self, output: Any) -> Any:
        """An eager call's output (the CPU pass-through, the lazy form's warm-up calls):
        refused where it carries a gradient path, as a capture is, so that the same code
        behaves the same on a CPU and a GPU."""
        if not self.records_gradients and torch.is_grad_enabled():
            why = outputs_needing_gradients(output)
            if why is not None:
                refuse_gradients(callable_name(self.fn), why)
        return output

    def answer_eagerly(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """Answer one call by running ``fn`` eagerly: another thread still holds outputs of
        the graph, which a replay would overwrite (``replay.OutputsInUse``)."""
        assert self.signature is not None
        self.signature.check(args, kwargs)
        self._costs.eager_calls += 1
        return self.fn(*args, **kwargs)

    def refresh(self, prepare: Callable[[], None] | None = None) -> bool:
        """Before a replay driven from above: capture again if a tensor read by address moved
        (or raise, with ``on_stale="raise"``). True when a new capture replaced the graph (its
        static buffers are new). ``prepare`` runs first, only when it will capture again: it
        puts the static inputs where the warm-up's runs of ``fn`` are safe (a decoder whose
        steps advance a position in place rewinds it)."""
        guard = self.guard
        if guard is None or (reason := guard.stale()) is None:
            return False
        if prepare is not None:
            prepare()
        self._when_stale(reason)
        return True

    def eager_warmup_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """One of the lazy form's warm-up calls: the caller's real call, run eagerly on the
        capture stream (allocator, cuBLAS handles and autotuning settle outside the recording),
        answered with its own result. It counts: N calls are N executions."""
        assert self.device is not None
        stream = self.options.stream or capture.default_stream(self.device)
        output = capture.run_on_side_stream(self.fn, args, kwargs, stream)
        self._costs.eager_calls += 1
        return self.prepare_eager_output(self.check_output_gradients(output))

    def prepare_eager_output(self, output: Any) -> Any:
        """What an eager call hands back (a training step detaches its loss here)."""
        return output

    def before_capture(self) -> None:
        """Called right before each capture (a training step resets gradients here)."""

    def make_guard(self) -> AddressGuard | None:
        """The guard checked before each replay (None when nothing is read by address and no
        plain value was read)."""
        guard = AddressGuard(self.fn, self.options.modules, watches=self.value_watches())
        return guard if guard.count else None

    def value_watches(self) -> list[ValueWatch]:
        """The watch over the plain values the last capture read, if it read any."""
        return [ValueWatch(self.read_values)] if self.read_values else []

    @property
    def stats(self) -> Stats:
        n_inputs = len(self.signature.tensor_index) if self.signature else 0
        guard = self.guard
        return snapshot(
            self.state.value, self._counters, self._costs, n_inputs=n_inputs,
            guarded=(guard.count, guard.addresses.backend) if guard is not None else (0, ""),
            state_writes=len(self.state_writes), recording=self.replayer and self.replayer.recording,
            notices=self.notices.counts,
        )  # fmt: skip

    @property
    def segments(self) -> list[dict[str, Any]]:
        """The recording's pieces in order: graphs and the eager steps between them."""
        return describe_segments(self.replayer and self.replayer.recording)

    def report(self, console: Any = None) -> None:
        """Print the segments: each eager step's line, why it runs eagerly, its calls and time."""
        print_segments(
            self.replayer and self.replayer.recording, callable_name(self.fn), self.stats, console
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
        name, options = callable_name(self.fn), self.options
        return f"<cudagraphs.Graphed {name} state={self.state.value} outputs={options.outputs}>"


def _cause(reason: str) -> str:
    """A stale guard's reason without the values it reports (``... changed from 0.9 to 0.8``,
    ``... (was ..., now ...)``): what stays the same when the same thing changes again."""
    return reason.split(" changed from ")[0].split(" (was ")[0]
