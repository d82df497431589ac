"""State a run writes, and putting it back: the library's own runs must leave no trace.

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
  a cache object) and :class:`Snapshot` copies a chosen set up front and checks versions after.
- CPU and CUDA RNG states are saved and restored with the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import compat
from .compat import OPS_DISPATCH_MODE, op_name, op_returns_alias, op_schema_arguments

__all__ = [
    "DeferredWriteRecorder",
    "RngState",
    "Snapshot",
    "Versions",
    "WriteRecorder",
    "Written",
    "storage_key",
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
    not seen here: :class:`Snapshot` covers those).
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
        for index, name in written_arguments(func):
            value = args[index] if index < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    key = storage_key(t)
                    if key not in self._skip:
                        label = self._names.get(key) or f"a tensor of shape {tuple(t.shape)}"
                        self._before_write(key, label, t)
        out = func(*args, **kwargs)
        if not _returns_alias(func):
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
# as written (BatchNorm's eager kernels): named here so their writes are seen too.
_UNMARKED_WRITES = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument an aten op writes in place (or into, ``out=``)."""
    found = _WRITES.get(func)
    if found is None:
        arguments = op_schema_arguments(func)
        unmarked = _UNMARKED_WRITES.get(op_name(func), ())
        found = tuple(
            (i, a.name)
            for i, a in enumerate(arguments)
            if (a.alias_info is not None and a.alias_info.is_write) or i in unmarked
        )
        _WRITES[func] = found
    return found


def _returns_alias(func: Any) -> bool:
    return op_returns_alias(func)


class Snapshot:
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
