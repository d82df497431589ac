"""Every option of ``cg.graph`` (and of the entry points built on it), declared once.

:class:`Options` is a frozen dataclass: its fields are the option names, their defaults and
their types, and ``__post_init__`` validates them all in one place. :class:`OptionKwargs` is the
same list for keyword typing (``**options: Unpack[OptionKwargs]``), and :func:`split_options`
separates options from a function's own keyword arguments, refusing near-misses such as
``warmpu=3`` that would otherwise be frozen silently as an example argument.

This module sits below the core: it imports nothing of the library but its errors.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict

import torch

from .errors import ConfigError, explain

__all__ = [
    "CAPTURE_ERROR_MODES",
    "CaptureErrorMode",
    "FallbackPolicy",
    "GuardPolicy",
    "OnStalePolicy",
    "SegmentPolicy",
    "SideEffectsPolicy",
    "OUTPUT_POLICIES",
    "SEGMENT_POLICIES",
    "SIDE_EFFECTS",
    "OptionKwargs",
    "Options",
    "OutputPolicy",
    "check_bool",
    "check_positive_int",
    "checked_keywords",
    "refuse_unknown_keywords",
    "split_options",
]

# The options whose value is one of a few names: each Literal is the one list of its choices
# (validation and messages read them with typing.get_args).
OutputPolicy = Literal["guarded", "alias", "clone"]
CaptureErrorMode = Literal["global", "thread_local", "relaxed"]
FallbackPolicy = Literal["raise", "eager"]
GuardPolicy = Literal["replay", "capture"]
OnStalePolicy = Literal["recapture", "raise"]
SideEffectsPolicy = Literal["restore", "keep", "raise"]
SegmentPolicy = Literal["split", "refuse"]

OUTPUT_POLICIES: tuple[str, ...] = typing.get_args(OutputPolicy)
CAPTURE_ERROR_MODES: tuple[str, ...] = typing.get_args(CaptureErrorMode)
#: What happens to state (tensors outside the inputs) that the library's own runs write.
SIDE_EFFECTS: tuple[str, ...] = typing.get_args(SideEffectsPolicy)
#: What an eager step (``@cg.eager``, ``eager=[...]``) reached while recording does.
SEGMENT_POLICIES: tuple[str, ...] = typing.get_args(SegmentPolicy)


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of ``cg.graph`` and of the entry points built on it, validated.

    Options:
        warmup: eager runs on a side stream before capture (allocator, cuBLAS, autotuning).
            With examples they run on clones of the examples and what they write is put back;
            without, the first ``warmup`` calls are your real calls, run eagerly and answered
            eagerly, and the next call captures and is answered by its own replay.
        outputs: ``"guarded"`` (default: aliases that raise once a later replay overwrote
            them), ``"alias"`` (the raw static outputs) or ``"clone"`` (fresh tensors).
        pool: share memory with other graphs: a :class:`cudagraphs.Pool`,
            ``torch.cuda.graph_pool_handle()`` or another captured graphed callable. Graphs
            sharing a pool must replay in capture order and never concurrently.
        stream: the side stream to warm up and capture on (default: one per device).
        capture_error_mode: CUDA's ``cudaStreamCaptureMode``; keep the default unless you
            know why.
        fallback: ``"raise"`` (a failed capture raises :class:`~cudagraphs.CaptureError`) or
            ``"eager"`` (log the reason once and run ``fn`` eagerly; ``g.fallback_reason``).
        guard: ``"replay"`` (default): before each replay, check that the tensors the graph
            reads by address (parameters and buffers of the modules involved, closure and
            global tensors) still live where they lived at capture, and that the plain Python
            values the capture read are unchanged; ``"capture"``: record them, never check.
        on_stale: when a guarded tensor moved (``param.data = ...``, ``model.to(...)``) or a
            value the capture read changed (``model.scale = 2.0``): ``"recapture"`` (default,
            logged once per cause) or ``"raise"`` (:class:`~cudagraphs.StaleGraphError`).
            In-place updates (``load_state_dict``) keep the graph valid.
        modules: modules ``fn`` uses that are not ``fn`` itself or its bound ``self``.
        verify: after capture, compare replays with eager on this many fresh random inputs
            (``True``: 3), each from the same state; a difference raises
            :class:`~cudagraphs.VerificationError` naming the output.
        side_effects: what happens to state outside the inputs (module buffers, a KV cache,
            RNG states) that the library's own runs write (warm-up on the examples, bucket
            probes, verification): ``"restore"`` (default: put back to the exact bytes, so N
            calls of yours are N executions), ``"keep"`` or ``"raise"``
            (:class:`~cudagraphs.StateWriteError`, after putting it back).
        replay_timeout_s: wait after each replay until the GPU finished it, at most this many
            seconds, then raise :class:`~cudagraphs.ReplayTimeoutError` (for graphs with
            collectives: a rank whose peers never replay errors instead of hanging). Costs the
            overlap of host and GPU; ``None`` (default): no wait.
        harmless_state: names of plain Python attributes (``"calls"``, or ``"Model.calls"``)
            that may change from run to run without changing what the GPU does (a logging
            counter): neither refused at capture nor guarded after it; ``"random"`` and
            ``"numpy.random"`` name the host's global random generators. Any other plain value
            the function changes between warm-up runs, and any draw from those generators,
            raises :class:`~cudagraphs.FrozenStateError` at capture.
        segments: what an eager step reached while recording does (a function marked with
            :func:`cudagraphs.eager`, a module of ``eager``): ``"split"`` (default: several
            graphs with the step run eagerly between them; ``g.segments`` lists them) or
            ``"refuse"`` (:class:`~cudagraphs.SegmentError`).
        eager: modules (instances, or classes matched against every module ``fn`` uses) whose
            forward runs eagerly between two graphs at every call (a mixture-of-experts block
            that reads its routing counts on the host: ``eager=[MixtralSparseMoeBlock]``).
    """

    warmup: int = 3
    outputs: OutputPolicy = "guarded"
    pool: Any = None
    stream: Any = None
    capture_error_mode: CaptureErrorMode = "global"
    fallback: FallbackPolicy = "raise"
    guard: GuardPolicy = "replay"
    on_stale: OnStalePolicy = "recapture"
    modules: Sequence[torch.nn.Module] = ()
    verify: int = 0
    side_effects: SideEffectsPolicy = "restore"
    replay_timeout_s: float | None = None
    harmless_state: Sequence[str] = ()
    segments: SegmentPolicy = "split"
    eager: Sequence[Any] = ()

    def __post_init__(self) -> None:
        for name, choices in _choices().items():
            _choice(name, getattr(self, name), choices)
        for name, checked in _CHECKED.items():  # each returns the value in its one form
            object.__setattr__(self, name, checked(getattr(self, name)))

    def replace(self, **changes: Any) -> Options:
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(
        cls, kwargs: dict[str, Any], *, entry: str, allowed: Sequence[str] | None = None
    ) -> Options:
        """Options from keyword arguments that must all be options (``allowed``: a subset)."""
        names = tuple(allowed) if allowed is not None else OPTION_NAMES
        unknown = {k: v for k, v in kwargs.items() if k not in names}
        refuse_unknown(entry, unknown, names)
        return cls(**kwargs)


class OptionKwargs(TypedDict, total=False):
    """:class:`Options` as keyword arguments, for ``Unpack`` typing (the same names and types;
    ``tests/test_options.py`` holds the two together)."""

    warmup: int
    outputs: OutputPolicy
    pool: Any
    stream: torch.cuda.Stream | None
    capture_error_mode: CaptureErrorMode
    fallback: FallbackPolicy
    guard: GuardPolicy
    on_stale: OnStalePolicy
    modules: Sequence[torch.nn.Module]
    verify: bool | int
    side_effects: SideEffectsPolicy
    replay_timeout_s: float | None
    harmless_state: Sequence[str]
    segments: SegmentPolicy
    eager: Sequence[Any]


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Options))
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Options)}


def split_options(
    fn: Callable[..., Any] | None,
    kwargs: dict[str, Any],
    *,
    extra: Sequence[str] = (),
    allowed: Sequence[str] | None = None,
    entry: str = "cg.graph",
    elsewhere: dict[str, Sequence[str]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options, example_kwargs)`` from one keyword dict, for every entry point that takes
    options and example keywords together (``allowed``: the entry's own options, default all).

    A keyword that is not an option, that ``fn`` does not accept (a module: its ``forward``),
    and that is close to an option name is a typo (``warmpu=3``, ``output="clone"``): raise
    :class:`ConfigError` naming the option, instead of freezing it as an example argument the
    first call then trips over. An option of ``cg.graph`` that this entry does not take, and
    that ``fn`` does not take either, raises too; so does an option of another object
    (``elsewhere``: its name and options, such as ``cg.Buckets(...)``'s ``overflow``), naming
    where it goes, and any keyword ``fn``'s signature does not take (``extra``: the entry's
    own parameters, matched for "did you mean" too).
    """
    names = (*(OPTION_NAMES if allowed is None else allowed), *extra)
    for key in kwargs:
        if key in OPTION_NAMES and key not in names and not _accepts(fn, key):
            raise ConfigError(
                explain(
                    f"{entry} does not take the option {key}=",
                    f"{entry} accepts only its own options: {', '.join(names)}",
                    f"remove {key}=, or use cg.graph for it",
                )
            )
    options = {k: v for k, v in kwargs.items() if k in names}
    rest = {k: v for k, v in kwargs.items() if k not in names}
    for key in rest:
        if _accepts(fn, key):
            continue
        for owner, theirs in (elsewhere or {}).items():
            near = difflib.get_close_matches(key, theirs, n=1, cutoff=0.75)
            if near:
                raise ConfigError(
                    explain(
                        f"{entry} got {key}={rest[key]!r}, "
                        + (
                            f"an option of {owner}"
                            if near[0] == key
                            else f"did you mean {near[0]}=, an option of {owner}?"
                        ),
                        f"{near[0]}= belongs to {owner}, not to {entry}",
                        f"pass it there: {owner.replace('...', near[0] + '=...')}",
                    )
                )
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
        if close or (fn is not None and _signature_known(fn)):
            hint = f": did you mean {close[0]}=?" if close else ""
            raise ConfigError(
                explain(
                    f"unknown keyword argument {key}={rest[key]!r}{hint}",
                    f"{key!r} is not an option of {entry}, and "
                    + (f"{_label(fn)} does not take it" if fn is not None else "no function does")
                    + " (an example keyword would be frozen into the graph)",
                    (f"spell it {close[0]}=...; " if close else "remove it; ")
                    + f"options are {', '.join(names)}",
                )
            )
    return options, rest


def checked_keywords(entry: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an ``__init__`` (or a method) whose keyword parameters are its options: a
    keyword it does not take raises :class:`ConfigError` with "did you mean" before Python's own error
    (``max_lenght=32`` would otherwise be "missing argument 'max_length'")."""

    def decorate(init: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
            refuse_unknown_keywords(entry, kwargs, init)
            return init(self, *args, **kwargs)

        return checked

    return decorate


def refuse_unknown_keywords(
    entry: str, given: dict[str, Any], signature_of: Callable[..., Any]
) -> None:
    """``ConfigError`` with "did you mean" for a keyword an entry point does not take (for
    entry points whose own keyword parameters, read from ``signature_of``, are their options:
    ``Decoder``, ``Batcher``)."""
    allowed = [
        p.name
        for p in inspect.signature(signature_of).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    ]
    refuse_unknown(entry, {k: v for k, v in given.items() if k not in allowed}, allowed)


def refuse_unknown(entry: str, unknown: dict[str, Any], allowed: Sequence[str]) -> None:
    """``ConfigError`` naming the first of ``unknown`` with the closest of ``allowed``."""
    for key, value in unknown.items():
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}=? " if close else ""
        raise ConfigError(
            explain(
                f"{entry} got an unknown option {key}={value!r}",
                f"{entry} accepts only its own options: {', '.join(allowed)}",
                f"{hint}remove or respell it",
            )
        )


def _accepts(fn: Callable[..., Any] | None, key: str) -> bool:
    if fn is None:
        return False
    if isinstance(fn, torch.nn.Module):  # its __call__ takes (*args, **kwargs): ask forward
        fn = fn.forward
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True  # cannot tell (a C function): let it through as an example argument
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == key and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def _signature_known(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s keyword parameters can be read (not for a C function)."""
    try:
        inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError):
        return False
    return True


def _label(fn: Any) -> str:
    return f"{getattr(fn, '__qualname__', None) or type(fn).__name__}()"


def _pool(pool: Any) -> Any:
    """A pool handle, a shared pool object (anything with ``handle``), or a graphed callable's."""
    if pool is None or hasattr(type(pool), "handle"):  # a cg.Pool (its handle is made lazily)
        return pool
    if isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(p, int) for p in pool):
        return pool
    if hasattr(pool, "pool"):  # a graphed callable: share its pool (None until captured)
        return _pool(pool.pool)
    raise ConfigError(
        explain(
            f"pool must be a cg.Pool, a graph pool handle or a graphed callable, got {pool!r}",
            "graphs that share a pool share one block of GPU memory",
            "pass pool=cg.Pool() (shared by every graph given it), "
            "pool=torch.cuda.graph_pool_handle(), or pool=other_graphed",
        )
    )


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        default = _DEFAULTS[name]
        raise ConfigError(
            explain(
                f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}",
                f"{name} selects a fixed behaviour and accepts only these names",
                f"pass {name}={default!r} (the default), or leave it out",
            )
        )


def check_bool(name: str, value: Any, why: str) -> None:
    """``ConfigError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ConfigError(
            explain(
                f"{name} must be True or False, got {value!r}", why, f"pass {name}=True or False"
            )
        )


def check_positive_int(name: str, value: Any, why: str) -> None:
    """``ConfigError`` unless ``value`` is an int >= 1 (a bool is not)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            explain(f"{name} must be a positive int, got {value!r}", why, f"pass {name}=1 or more")
        )


def _warmup(warmup: Any) -> int:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(
            explain(
                f"warmup must be an int >= 0, got {warmup!r}",
                "it is the number of eager calls run before capture",
                "pass warmup=3 (the default) or more for torch.compile'd functions",
            )
        )
    return warmup


def _modules(modules: Any) -> tuple[torch.nn.Module, ...]:
    modules = tuple(modules)
    if not all(isinstance(m, torch.nn.Module) for m in modules):
        raise ConfigError(
            explain(
                "modules must be a sequence of torch.nn.Module",
                "their parameters and buffers are the tensors the graph reads by address",
                "pass modules=[model] (the modules fn uses that are not fn itself)",
            )
        )
    return modules


def _verify(verify: Any) -> int:
    if isinstance(verify, bool):
        verify = 3 if verify else 0
    if not isinstance(verify, int) or verify < 0:
        raise ConfigError(
            explain(
                f"verify must be a bool or an int >= 0, got {verify!r}",
                "it is the number of fresh random inputs a new graph is checked on",
                "pass verify=True (3 inputs) or verify=5",
            )
        )
    return verify


def _stream(stream: Any) -> Any:
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise ConfigError(
            explain(
                f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}",
                "capture needs a CUDA side stream to record on",
                "pass stream=torch.cuda.Stream(), or leave it out",
            )
        )
    return stream


def _harmless_state(harmless: Any) -> tuple[str, ...]:
    if isinstance(harmless, str):
        harmless = (harmless,)
    if not isinstance(harmless, (tuple, list)) or not all(
        isinstance(h, str) and h for h in harmless
    ):
        raise ConfigError(
            explain(
                f"harmless_state must be a tuple of attribute names, got {harmless!r}",
                "it names plain Python values the function may change from run to run "
                "without changing what the GPU does (a logging counter)",
                "pass harmless_state=('calls',) or harmless_state=('Model.calls',)",
            )
        )
    return tuple(harmless)


def _eager(eager: Any) -> tuple[Any, ...]:
    if isinstance(eager, (torch.nn.Module, type)):
        eager = (eager,)
    if not isinstance(eager, (tuple, list)) or not all(
        isinstance(e, torch.nn.Module) or (isinstance(e, type) and issubclass(e, torch.nn.Module))
        for e in eager
    ):
        raise ConfigError(
            explain(
                f"eager must be a list of modules or module classes, got {eager!r}",
                "each module named there runs eagerly between two graphs (a gap), at every call",
                "pass eager=[model.router] or eager=[MixtralExperts]; for a function, mark "
                "it with @cg.eager instead",
            )
        )
    return tuple(eager)


def _replay_timeout(timeout: Any) -> float | None:
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise ConfigError(
            explain(
                f"replay_timeout_s must be a number of seconds > 0 or None, got {timeout!r}",
                "it bounds how long a call waits for its replay to finish",
                "pass replay_timeout_s=30.0, or leave it out (no wait)",
            )
        )
    return timeout


@functools.cache
def _choices() -> dict[str, tuple[str, ...]]:
    """Options whose value is one of a few names: read from their Literal types."""
    hints = typing.get_type_hints(Options)
    return {
        name: typing.get_args(hint)
        for name, hint in hints.items()
        if typing.get_origin(hint) is Literal
    }


#: The other options' checks, each returning the value in the one form the library uses.
_CHECKED: dict[str, Callable[[Any], Any]] = {
    "warmup": _warmup,
    "modules": _modules,
    "verify": _verify,
    "stream": _stream,
    "pool": _pool,
    "harmless_state": _harmless_state,
    "eager": _eager,
    "replay_timeout_s": _replay_timeout,
}
