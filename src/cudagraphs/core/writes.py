"""State a run writes outside its inputs, and putting it back: the library's own runs leave no
trace.

Warm-up, verification and the doctor run the function for real. A real model writes state that
is not among its inputs (a KV cache and its position counter, BatchNorm running statistics, an
environment, RNG offsets); every such extra run would advance it once more. This module records
what a run writes and restores it to its exact bytes afterwards:

- :class:`WriteRecorder`, a dispatch mode, sees every in-place and ``out=`` write of eager code
  and copies the written tensor's whole storage once, before its first write (so memory grows
  only by what is written, and views and aliases restore together). Tensors created during the
  run and the call's own inputs are never copied.
- Code compiled by ``torch.compile`` writes from inside its kernels, unseen by a dispatch mode
  (and Dynamo would refuse to compile under one that did not step aside). Such writes still bump
  the tensors' version counters, so :func:`reachable_tensors` collects what the function can
  reach (module state, closure and global tensors, tensors inside the objects it reads, such as
  a cache object) and :class:`TensorSnapshot` copies a chosen set up front and checks versions after.
- CPU and CUDA RNG states are saved and restored with the rest.

The ``side_effects`` option. Warm-up on the examples, bucket probes, recaptures, verification and the doctor run the function
for real. :class:`SideEffects` wraps such runs: with ``"restore"`` (the default) every tensor they
write outside the call's inputs and the RNG states are put back afterwards (found as above), ``"keep"`` lets the runs count, and
``"raise"`` puts everything back and refuses (:class:`~cudagraphs.errors.StateWriteError`).

What a function can reach beyond its arguments. A recording reads and writes more than its inputs: module parameters and buffers, a cache
object's layers, closure tensors, the plain Python values in all of these. :func:`walk` visits
them, named as a user would write them (``model.layers[0].attn``, ``cache.layers[1]``), in a
bounded walk (depth 6, 20000 objects): its module or bound ``self``, its closure cells and the
globals its own code names, the closures of functions found on the way, the objects those hold,
and any extra roots (the call's plain arguments). :func:`reachable_tensors` keeps the tensors
(what warm-up may write); ``python_values`` keeps the plain values (what a recording freezes).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CudaGraphsWarning, StateWriteError, explain
from . import compat
from .compat import OPS_DISPATCH_MODE, op_name, op_returns_alias, op_schema_arguments
from .frames import callable_name, is_model_class, slot_values, user_stacklevel

__all__ = [
    "DeferredWriteRecorder",
    "RngState",
    "SideEffects",
    "TensorSnapshot",
    "Versions",
    "WriteRecorder",
    "Written",
    "bound_arguments",
    "is_compiled",
    "named_roots",
    "reachable_tensors",
    "report",
    "storage_key",
    "walk",
    "written_arguments",
]


def storage_key(t: torch.Tensor) -> int:
    """The address of a tensor's storage (0 for none): one key for all views of one memory."""
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor subclass or meta tensor without real storage
        return 0


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage behind ``t``."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))


class RngState:
    """The CPU and every initialized CUDA device's default RNG state, to put back later."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class _Saved:
    name: str
    tensor: torch.Tensor  # a view of the storage: keeps it alive and gives its device
    copy: torch.Tensor  # the storage's bytes before the first write


@dataclass
class Written:
    """What a run wrote outside its inputs: one entry per storage, with a name to report."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0


class _Store:
    """Copies of storages taken before they changed, restorable in one go."""

    def __init__(self) -> None:
        self.saved: dict[int, _Saved] = {}

    def save(self, key: int, name: str, t: torch.Tensor) -> None:
        if key and key not in self.saved:
            full = _storage_bytes(t)
            self.saved[key] = _Saved(name, full, full.clone())

    def restore(self) -> None:
        with torch.no_grad():
            for saved in self.saved.values():
                storage = saved.tensor.untyped_storage()
                if storage.nbytes() != saved.copy.numel():
                    # The run resized the storage after writing it (FSDP frees a layer's
                    # gathered parameters so): give it back its size first, or the copy would
                    # write past the memory it holds now.
                    storage.resize_(saved.copy.numel())
                saved.tensor.copy_(saved.copy)

    def written(self) -> Written:
        result = Written()
        for saved in self.saved.values():
            result.names.append(saved.name)
            result.tensors.append(saved.tensor)
            result.nbytes += saved.copy.numel()
        return result


class WriteRecorder(OPS_DISPATCH_MODE):  # type: ignore[misc, valid-type]
    """A dispatch mode that copies each storage an eager run writes, before the first write.

    Right::

        with WriteRecorder(exclude=inputs, names=names) as recorder:
            fn(*inputs)
        recorder.restore()          # the world as it was (RNG included)

    It steps aside for compiled code (Dynamo compiles under it; the compiled kernels' writes are
    not seen here: :class:`TensorSnapshot` covers those).
    """

    def __init__(
        self, exclude: Iterable[torch.Tensor] = (), names: dict[int, str] | None = None
    ) -> None:
        super().__init__()
        self._store = _Store()
        self._skip = {storage_key(t) for t in exclude}
        self._skip.discard(0)
        self._names = names or {}
        self._rng = RngState()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this Dynamo refuses to compile under the mode and marks the code as never to
        # be compiled again: a warm-up would silently turn torch.compile off for good.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for index, name in written_arguments(func, args, kwargs):
            value = args[index] if index < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    key = storage_key(t)
                    if key not in self._skip:
                        label = self._names.get(key) or f"a tensor of shape {tuple(t.shape)}"
                        self._before_write(key, label, t)
        out = func(*args, **kwargs)
        if not op_returns_alias(func):
            # Created by this run: writing into it later changes nothing outside the run.
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self._skip.add(storage_key(t))
        return out

    def _before_write(self, key: int, label: str, t: torch.Tensor) -> None:
        """A storage from outside the run is about to be written: copy it (once)."""
        self._store.save(key, label, t)

    def written(self) -> Written:
        return self._store.written()

    def restore(self) -> None:
        """Put back every storage written under the mode, and the RNG states."""
        self._store.restore()
        self._rng.restore()


class DeferredWriteRecorder(WriteRecorder):
    """A :class:`WriteRecorder` that also works across a recording: a write recorded into a
    graph has not happened yet, so the storage it targets is noted and copied at
    :meth:`flush`, called right before the recorded work runs for real (a segmented capture
    replays each segment before the eager gap after it)."""

    def __init__(
        self, exclude: Iterable[torch.Tensor] = (), names: dict[int, str] | None = None
    ) -> None:
        super().__init__(exclude, names)
        self._pending: dict[int, tuple[str, torch.Tensor]] = {}

    def _before_write(self, key: int, label: str, t: torch.Tensor) -> None:
        if torch.cuda.is_current_stream_capturing():
            self._pending.setdefault(key, (label, t))  # recorded, not run yet: copy at flush
        else:
            super()._before_write(key, label, t)

    def flush(self) -> None:
        """Copy the storages the recording so far writes, before it runs for real."""
        for key, (label, t) in self._pending.items():
            self._store.save(key, label, t)
        self._pending.clear()


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
# Ops that update running statistics in place although their schemas do not mark the arguments
# as written (BatchNorm's eager kernels): the arguments they write, and the flag under which
# they do. In eval() (``training=False``) they only read the statistics: no write to report.
_UNMARKED_WRITES: dict[str, tuple[tuple[int, ...], int]] = {
    "aten::native_batch_norm": ((3, 4), 5),
    "aten::cudnn_batch_norm": ((3, 4), 5),
    "aten::miopen_batch_norm": ((3, 4), 5),
}


def written_arguments(
    func: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument an aten op writes in place (or into, ``out=``)
    when called with ``args`` and ``kwargs``."""
    found = _WRITES.get(func)
    if found is None:
        found = tuple(
            (i, a.name)
            for i, a in enumerate(op_schema_arguments(func))
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[func] = found
    unmarked = _UNMARKED_WRITES.get(op_name(func))
    if unmarked is None:
        return found
    positions, flag = unmarked
    arguments = op_schema_arguments(func)
    flag_name = arguments[flag].name
    if not (args[flag] if flag < len(args) else (kwargs or {}).get(flag_name, False)):
        return found
    return (*found, *((i, arguments[i].name) for i in positions))


class TensorSnapshot:
    """Bytes of chosen tensors copied now, and their version counters, to restore and compare.

    For what a dispatch mode cannot see (compiled kernels): copy the candidates up front, run,
    and ``restore()``; ``changed()`` names the candidates whose version moved.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._store = _Store()
        self._versions: list[tuple[str, torch.Tensor, int]] = []
        for name, t in named:
            self._store.save(storage_key(t), name, t)
            if not t.is_inference():  # inference tensors keep no version counter
                self._versions.append((name, t, compat.version(t)))
        self._rng = RngState()

    def changed(self) -> list[str]:
        return [name for name, t, version in self._versions if compat.version(t) != version]

    def restore(self) -> None:
        self._store.restore()
        self._rng.restore()

    def written(self) -> Written:
        """The snapshot's tensors whose version moved (what a run wrote, of these)."""
        moved = {storage_key(t) for _, t, v in self._versions if compat.version(t) != v}
        result = Written()
        for key, saved in self._store.saved.items():
            if key in moved:
                result.names.append(saved.name)
                result.tensors.append(saved.tensor)
                result.nbytes += saved.copy.numel()
        return result


class Versions:
    """Version counters of named tensors now, to ask later which were written."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Inference tensors (a model built under torch.inference_mode()) keep no version
        # counter; outside inference mode nothing can write them in place anyway.
        self._versions = [(name, t, compat.version(t)) for name, t in named if not t.is_inference()]

    def changed(self, ignore: Iterable[torch.Tensor] = ()) -> list[str]:
        skip = {storage_key(t) for t in ignore}
        return [
            name
            for name, t, version in self._versions
            if compat.version(t) != version and storage_key(t) not in skip
        ]


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
            TensorSnapshot((n, t) for n, t in reachable if not isinstance(t, torch.nn.Parameter))
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


_MAX_OBJECTS = 20000
_MAX_DEPTH = 6
_OPAQUE = (str, bytes, int, float, bool, complex, type, type(None), torch.dtype, torch.device)


def walk(fn: Callable[..., Any], roots: Iterable[Any] = ()) -> Iterator[tuple[str, Any]]:
    """``(name, object)`` for each object ``fn`` can reach, once each; tensors are yielded but
    not entered, plain values are not yielded (read them from their owner's ``__dict__``)."""
    seen: set[int] = set()
    # Breadth first: each object is reached by its shortest path, so one reached deep first
    # (a compiled module's model, also two levels down its forward's closure) keeps the
    # depth its own root gives it, and the deep end of the model is not cut off.
    stack: collections.deque[tuple[str, Any, int]] = collections.deque(
        (name, value, 0) for name, value in named_roots(fn)
    )
    stack.extend((f"argument {type(r).__name__}", r, 0) for r in roots)
    # Hooks run around every module's forward: what their closures hold is read too.
    stack.extend(
        (label, h, 0) for label, hooks in compat.global_hook_dicts() for h in hooks.values()
    )
    while stack and len(seen) < _MAX_OBJECTS:
        name, obj, depth = stack.popleft()
        if isinstance(obj, _OPAQUE) or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield name, obj
        if isinstance(obj, torch.Tensor) or depth >= _MAX_DEPTH:
            continue
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            # A function it calls keeps its own state in its closure (or its bound object).
            stack.extend((f"{name}{suffix}", child, depth + 1) for suffix, child in _closure(obj))
            continue
        if isinstance(obj, functools.partial):  # its bound arguments are what it reads
            stack.extend((f"{name}{suffix}", child, depth + 1) for suffix, child in _bound(obj))
            continue
        if callable(obj) and not isinstance(obj, torch.nn.Module) and not is_user_object(obj):
            continue
        stack.extend((f"{name}{suffix}", child, depth + 1) for suffix, child in _children(obj))


def reachable_tensors(
    fn: Callable[..., Any], roots: Iterable[Any] = (), exclude: Iterable[torch.Tensor] = ()
) -> list[tuple[str, torch.Tensor]]:
    """Tensors ``fn`` can reach (see :func:`walk`), one entry per storage, named; ``exclude``
    (the inputs) is left out."""
    skip = {storage_key(t) for t in exclude}
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, obj in walk(fn, roots):
        if isinstance(obj, torch.Tensor):
            key = storage_key(obj)
            if key and key not in skip and key not in found and obj.device.type != "meta":
                found[key] = (name, obj)
    return list(found.values())


def is_user_object(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a class the user's code defines (an RL policy holding
    its modules, an agent, a step object with ``__call__``): its attributes are state a graph
    reads, as a module's are. Library callables (torch's operators, compiled wrappers) are not
    entered."""
    if isinstance(obj, (type, types.FunctionType, types.MethodType, torch.nn.Module)):
        return False
    return hasattr(obj, "__dict__") and is_model_class(type(obj))


def _bound(partial: functools.partial) -> Iterator[tuple[str, Any]]:
    yield ".func", partial.func
    for k, value in enumerate(partial.args):
        yield f".args[{k}]", value
    for key, value in partial.keywords.items():
        yield f".keywords[{key!r}]", value


def bound_arguments(objects: Iterable[tuple[str, Any]]) -> list[tuple[str, dict, str, Any]]:
    """``(label, owner, key, value)`` for what each ``functools.partial`` among ``objects``
    binds: the function reads it as an argument, under no name a guard of attributes or
    globals keeps. Every keyword (its dict is the owner: ``p.keywords["scale"] = 2.0``), and
    each list bound as a positional argument, which the tuple holding it keeps as the same
    object (its owner a dict of its own, so that the list's items are what can change)."""
    found: list[tuple[str, dict, str, Any]] = []
    for label, obj in objects:
        if isinstance(obj, functools.partial):
            for key, value in obj.keywords.items():
                found.append((f"{label}.keywords[{key!r}]", obj.keywords, key, value))
            for k, value in enumerate(obj.args):
                if type(value) is list:
                    found.append((f"{label}.args[{k}]", {"list": value}, "list", value))
    return found


def named_roots(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """What ``fn`` reads beyond its arguments: its module, bound ``self`` or the user's callable
    object itself, its closure cells and the globals its own code (or its class's ``__call__``)
    names, each with the name it has there."""
    if isinstance(fn, functools.partial):  # what the function reads, and what is bound to it
        bound = [(f"partial{suffix}", value) for suffix, value in _bound(fn) if suffix != ".func"]
        return named_roots(fn.func) + bound
    roots: list[tuple[str, Any]] = []
    for candidate in (fn, getattr(fn, "__self__", None), getattr(fn, "_orig_mod", None)):
        if (
            isinstance(candidate, torch.nn.Module)
            or (candidate is not None and candidate is not fn and hasattr(candidate, "__dict__"))
            or (candidate is fn and is_user_object(fn))
        ):
            roots.append((type(candidate).__name__, candidate))
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    if isinstance(target, functools.partial) and target is not fn:
        # torch.compile(partial) wraps the partial in a function of Dynamo's: the partial, what
        # it binds and its function are what the wrapper runs.
        return [*roots, ("partial", target)]
    if getattr(target, "__code__", None) is None and is_user_object(fn):
        target = getattr(type(fn).__call__, "__func__", type(fn).__call__)
    code = getattr(target, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):
                roots.append((name, cell.cell_contents))
        namespace = getattr(target, "__globals__", {})
        roots.extend((n, namespace[n]) for n in code.co_names if n in namespace)
    return roots


def _closure(fn: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(fn, types.MethodType):
        yield "", fn.__self__
        return
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):
            yield f"->{name}", cell.cell_contents


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.nn.Module):
        for name, t in obj.named_parameters(recurse=False):
            yield f".{name}", t
        for name, t in obj.named_buffers(recurse=False):
            yield f".{name}", t
        for name, child in obj.named_children():
            yield f".{name}", child
        for label, hooks in compat.module_hook_dicts(obj, recurse=False):
            kind = label.split("'s ")[-1]  # "forward hooks", "forward pre hooks"
            yield from ((f"'s {kind}", hook) for hook in list(hooks.values()))
        values = obj.__dict__.items()
        for key, value in values:
            if not key.startswith("_") and not isinstance(value, torch.nn.Module):
                yield f".{key}", value
        return
    if isinstance(obj, torch.optim.Optimizer):
        for k, state in enumerate(obj.state.values()):
            yield f".state[{k}]", state
        yield ".param_groups", obj.param_groups
        return
    if isinstance(obj, dict):
        for key, value in list(obj.items())[:1000]:
            yield f"[{key!r}]", value
        return
    if isinstance(obj, (list, tuple)):
        for k, value in enumerate(obj[:1000]):
            yield f"[{k}]", value
        return
    if inspect.ismodule(obj):
        return
    attributes = vars(obj) if hasattr(obj, "__dict__") else slot_values(obj)
    for key, value in list(attributes.items())[:1000]:
        yield f".{key}", value


def is_compiled(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is, or directly calls through, a ``torch.compile``'d callable."""
    candidates = [fn, getattr(fn, "__self__", None)]
    candidates.extend(value for _, value in named_roots(fn))
    return any(
        hasattr(c, "_torchdynamo_orig_callable") or type(c).__name__ == "OptimizedModule"
        for c in candidates
        if c is not None
    )
