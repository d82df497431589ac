"""A capture: one object that takes a function from its example call to a ready replay path,
in the phases every capture goes through (:class:`Capture`), and the device a call is captured
on (:func:`place`).

1. **prepare**: the caller's modes (what every replay is checked against); the static input
   buffers (clones of the examples, so that warm-up never touches them); the watches over the
   Python state the runs may change;
2. **warm up**: eager runs on the side stream (``side_stream.warm_up``), what they write
   outside the inputs put back (``writes.SideEffects``);
3. **record**: one call recorded (``recording.capture_call``, split at eager steps), with the
   Python values it read (``python_values``); ranks compare the collectives each issued
   (``collectives``: ranks whose graphs differ would hang at the first replay);
4. **check**: a Python value or a host generator the runs changed is refused
   (``frozen_state``); the inputs the function wrote in place (their version counters); outputs
   that would carry a gradient path in eager but never in a replay are refused;
5. **finish**: the replay path (``replay.Replayer``), handed back as one :class:`Captured`.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..errors import ConfigError, explain
from ..options import Options
from . import collectives, compat, python_values, segments, writes
from .frames import callable_name
from .frozen_state import PythonSnapshot
from .guards import modules_of
from .host_draws import DrawWatch, HostDraws
from .modes import Modes, outputs_needing_gradients, refuse_gradients
from .outputs import detach_outputs
from .recording import Recording, RecordingSetup, capture_call
from .replay import Counters, Replayer
from .side_stream import default_stream, run_on_side_stream, warm_up
from .signature import Signature
from .writes import Written

__all__ = [
    "Capture",
    "Captured",
    "Recording",
    "RecordingSetup",
    "capture_call",
    "default_stream",
    "eager_modules",
    "graphable",
    "place",
    "run_on_side_stream",
    "warm_up",
]

_capture_lock = threading.RLock()  # one capture at a time per process: captures share streams


def graphable(tensor: torch.Tensor) -> bool:
    """Whether a tensor can be a graph input: it lives in CUDA memory."""
    return tensor.is_cuda


def place(paths: list[str], tensors: list[torch.Tensor]) -> torch.device | str:
    """The CUDA device a call with these tensor inputs is captured on, or why it cannot be
    (a reason to run eagerly). Refuses inputs split across devices."""
    cuda = [t.device for t in tensors if graphable(t)]
    other = [(p, t.device) for p, t in zip(paths, tensors) if not graphable(t)]
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
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if other:
        return f"the inputs are on {other[0][1]}, not CUDA"
    return cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())


@dataclass
class Captured:
    """What a capture hands back, kept whole by the graphed callable: the replay path, the
    static inputs arranged like the example call, and what the runs found and cost."""

    replayer: Replayer
    inputs: tuple[Any, ...]
    input_kwargs: dict[str, Any]
    recording: Recording
    written: Written  # what warm-up wrote outside the inputs (put back under "restore")
    mutated: tuple[int, ...]  # leaf indices of the inputs the function writes in place
    warmup_s: float
    static_input_bytes: int
    # The plain values the recording read, checked before every replay (python_values.py).
    values: list[tuple[str, Any, str, Any]] = field(default_factory=list)


class Capture:
    """One capture of ``fn`` on one device, in phases (the module's docstring): create it with
    what stays the same across its phases, then :meth:`run` it on the example leaves.

    ``grad_sources`` is ``None`` for a recording that runs its own backward (a training step);
    otherwise the tensors whose ``requires_grad`` a replay must refuse. ``adopt_inputs``: the
    example tensors themselves become the static inputs (a layer above owns them, as buckets
    own views of one buffer), and the caller fills them before each replay.
    """

    def __init__(
        self,
        fn: Any,
        signature: Signature,
        options: Options,
        *,
        device: torch.device,
        counters: Counters,
        grad_sources: list[torch.Tensor] | None,
        adopt_inputs: bool = False,
    ) -> None:
        self.fn, self.signature, self.options = fn, signature, options
        self.name = callable_name(fn)
        self.device = device
        self.stream = options.stream or default_stream(device)
        self.counters = counters
        self.grad_sources = grad_sources
        self.adopt_inputs = adopt_inputs
        self.draws: DrawWatch | None = None  # while the runs are watched (run)

    def run(self, leaves: list[Any], *, warmup: int, settled: bool) -> Captured:
        """``warmup`` eager runs on the static inputs, then the recording. ``settled``: the
        function already ran for real (the lazy form's eager calls), so the state before the
        capture counts as a settled run for the Python-state check."""
        self.prepare(leaves, settled=settled)
        with _capture_lock:
            # Which runs of this thread call the shared random generator: another thread's
            # draws move its state too, and are not the function's.
            with DrawWatch() as self.draws:
                if self.host.runs:  # a settled run is the first: watch from the next one
                    self.draws.start()
                self.warm_up(warmup)
                self.record()
            self.check(restore=bool(warmup) and self.options.side_effects == "restore")
        return self.finish()

    def prepare(self, leaves: list[Any], *, settled: bool) -> None:
        signature = self.signature
        self.modes = Modes(self.name)
        # Normal (not inference) tensors, so that in-place writes by the function show in
        # their version counters.
        static = list(leaves)
        if not self.adopt_inputs:
            with torch.inference_mode(False), torch.no_grad():
                for i in signature.tensor_index:
                    static[i] = leaves[i].detach().clone()
        self.static = static
        self.args, self.kwargs = optree.tree_unflatten(signature.spec, static)
        self.inputs = [static[i] for i in signature.tensor_index]
        self.roots = [static[i] for i in signature.frozen_index]
        self.plain = PythonSnapshot(self.fn, self.roots, self.options.harmless_state)
        self.host = HostDraws(self.name, self.options.harmless_state)
        if settled:
            self._after_run()

    def _after_run(self) -> None:
        self.plain.take()
        self.host.take(seen=self.draws.pop() if self.draws is not None else None)
        if self.draws is not None:
            self.draws.start()  # the runs after this one are compared with it

    def warm_up(self, runs: int) -> None:
        policy = self.options.side_effects if runs else "keep"
        effects = writes.SideEffects(self.fn, self.inputs, self.roots, policy)
        with effects.running():
            self.warmup_s = warm_up(
                self.fn, self.args, self.kwargs, runs, self.stream,
                checked=functools.partial(collectives.compared_across_ranks, f"{self.name} (warm-up)"),
                after_each=self._after_run,
            )  # fmt: skip
        self.written = effects.finish()
        writes.report(effects, self.fn)
        self.versions = [compat.version(x) for x in self.inputs]

    def record(self) -> None:
        options, shared = self.options, self.options.pool
        setup = RecordingSetup(
            stream=self.stream,
            pool=shared.handle if hasattr(type(shared), "handle") else shared,
            capture_error_mode=options.capture_error_mode,
            segments=options.segments,
            eager_modules=eager_modules(self.fn, options),
            exclude=self.inputs,
            restore=options.side_effects != "keep",
        )
        reader = python_values.Reader(of=self.fn)
        with collectives.compared_across_ranks(self.name), reader:
            copies = () if self.adopt_inputs else self.inputs
            self.recording = capture_call(self.fn, self.args, self.kwargs, setup, copies)
        self._after_run()
        self.values = python_values.read_values(
            reader, self.plain.runs[-1], options.harmless_state, self.plain.objects
        )
        segments.announce(self.recording.graph, self.name)
        if hasattr(type(shared), "record"):
            shared.record(self.recording.pool_bytes)

    def check(self, *, restore: bool) -> None:
        """``restore``: values the runs changed go back (only where the runs were the
        library's own, on the examples)."""
        self.plain.check(restore=restore)
        self.host.check()
        self.mutated = tuple(
            i
            for i, x, before in zip(self.signature.tensor_index, self.inputs, self.versions)
            if compat.version(x) != before
        )
        output = self.recording.output
        why = None if self.grad_sources is None else outputs_needing_gradients(output)
        if why is not None and self.modes.seen["grad mode"] == "on":
            refuse_gradients(self.name, why)

    def finish(self) -> Captured:
        # The graphs of one pool share memory, so they keep one stream order.
        shared, options, recording = self.options.pool, self.options, self.recording
        order = (
            shared.stream_order(self.device.index)
            if hasattr(type(shared), "stream_order")
            else None
        )
        replayer = Replayer(
            recording.graph, self.signature, self.static, list(self.mutated),
            detach_outputs(recording.output), options.outputs, self.counters, modes=self.modes,
            timeout_s=options.replay_timeout_s, name=self.name, copies=recording.copies,
            device=self.device.index, grad_sources=self.grad_sources, order=order,
        )  # fmt: skip
        inputs, input_kwargs = optree.tree_unflatten(self.signature.spec, self.static)
        return Captured(
            replayer=replayer,
            inputs=inputs,
            input_kwargs=input_kwargs,
            recording=recording,
            written=self.written,
            mutated=self.mutated,
            warmup_s=self.warmup_s,
            static_input_bytes=sum(self.static[i].nbytes for i in self.signature.tensor_index),
            values=self.values,
        )


def eager_modules(fn: Any, options: Options) -> list[torch.nn.Module]:
    """The modules the ``eager`` option names: instances as given, classes matched against
    every module ``fn`` uses. A class that matches nothing is a mistake worth an error."""
    if not options.eager:
        return []
    used = [m for root in modules_of(fn, options.modules) for m in root.modules()]
    found: list[torch.nn.Module] = []
    for entry in options.eager:
        if isinstance(entry, torch.nn.Module):
            matches = [entry]
        else:
            matches = [m for m in used if isinstance(m, entry)]
            if not matches:
                raise ConfigError(
                    explain(
                        f"eager=[{entry.__name__}] matches no module of {callable_name(fn)}",
                        "the option names the modules that run eagerly between two graphs",
                        "check the class (type(model.layers[0].mlp)), or pass the module itself",
                    )
                )
        found += [m for m in matches if all(m is not f for f in found)]
    # A module inside another eager module runs inside that one's gap already.
    inside = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inside]
