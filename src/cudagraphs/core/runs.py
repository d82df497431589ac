"""The runs a capture makes: warm-up on the static inputs, then the recording, with what they
changed found and put back.

Around the runs: the writes to tensors outside the inputs (``side_effects``: restored after a
warm-up on the library's own account), the plain Python values the function changes from run
to run (``python_state``: refused), the inputs the function writes in place (their version
counters), and the collectives each rank issued (``collectives``: compared across ranks, since
ranks whose graphs differ would hang at the first replay).
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
from . import collectives, compat, python_state, read_values, recorder, segments, side_effects
from .frames import callable_name
from .guards import modules_of
from .recorder import Recording
from .tree import Signature
from .written_state import Written

__all__ = ["Run", "eager_modules", "warm_up_and_capture"]

_capture_lock = threading.RLock()  # one capture at a time per process: captures share streams


@dataclass
class Run:
    recording: Recording
    written: Written  # what warm-up wrote outside the inputs (put back under "restore")
    mutated: list[int]  # leaf indices of the inputs the function writes in place
    warmup_s: float
    # The plain values the capture read, checked before every replay (read_values.py).
    values: list[tuple[str, Any, str, Any]] = field(default_factory=list)


def warm_up_and_capture(
    fn: Any,
    signature: Signature,
    static: list[Any],
    options: Options,
    *,
    warmup: int,
    stream: Any,
    settled: bool,
    copy_inputs: bool = True,
) -> Run:
    """``warmup`` eager runs of ``fn`` on the static input leaves ``static``, then the capture.

    ``settled``: the function already ran for real before (the lazy form's eager calls), so
    the state before the capture counts as a settled run for the Python-state check.
    ``copy_inputs``: the recording copies the inputs in itself (``copy_nodes``); off where a
    caller fills the static inputs itself before each replay (buckets).
    """
    name = callable_name(fn)
    args, kwargs = optree.tree_unflatten(signature.spec, static)
    inputs = [static[i] for i in signature.tensor_index]
    roots = [static[i] for i in signature.frozen_index]
    plain = python_state.Snapshot(fn, roots, options.harmless_state)
    if settled:
        plain.take()
    with _capture_lock:
        effects = side_effects.SideEffects(
            fn, inputs, roots, options.side_effects if warmup else "keep"
        )
        with effects.running():
            warmup_s = recorder.warm_up(
                fn, args, kwargs, warmup, stream,
                checked=functools.partial(collectives.compared_across_ranks, f"{name} (warm-up)"),
                after_each=plain.take,
            )  # fmt: skip
        written = effects.finish()
        side_effects.report(effects, fn)
        versions = [compat.version(x) for x in inputs]
        shared = options.pool
        # Ranks whose graphs hold different collectives would hang at the first replay.
        reader = read_values.Reader()
        with collectives.compared_across_ranks(name), reader:
            recording = recorder.capture(
                fn,
                args,
                kwargs,
                stream=stream,
                pool=shared.handle if hasattr(type(shared), "handle") else shared,
                capture_error_mode=options.capture_error_mode,
                segments=options.segments,
                eager_modules=eager_modules(fn, options),
                exclude=inputs,
                restore=options.side_effects != "keep",
                copy_inputs=inputs if copy_inputs else (),
            )
        plain.take()
        values = read_values.read_values(reader, plain.runs[-1], options.harmless_state)
        segments.announce(recording.graph, name)
        if hasattr(type(shared), "record"):
            shared.record(recording.pool_bytes)
        # Values the runs changed go back only where the runs were the library's own.
        plain.check(restore=bool(warmup) and options.side_effects == "restore")
    mutated = [
        i
        for i, x, before in zip(signature.tensor_index, inputs, versions)
        if compat.version(x) != before
    ]
    return Run(recording, written, mutated, warmup_s, values)


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
