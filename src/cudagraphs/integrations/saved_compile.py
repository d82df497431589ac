"""A compiled decode step written to disk, so that a second process loads it instead of
tracing the model again.

``torch.compile`` keeps its compiled kernels on disk, but a new process still traces the whole
model through Dynamo before it finds them: seconds for a 22-layer model (``reports/gpu.md``,
``decode_startup.py``). A :class:`SavedCompile` compiles with ``aot_compile`` instead and
writes the result next to Inductor's own cache; a later process loads it and runs it, with no
trace.

Nothing loaded may give another answer than a fresh compile would, so a file is used only
when all of these hold, and is compiled again (and rewritten) otherwise:

* its name is a hash of everything a trace depends on that its guards do not check: the
  versions of Python, torch, transformers and cudagraphs, the GPU, the model's class, config
  (its attention implementation too) and dtypes, the compile settings, Inductor's settings and the float32 matmul, TF32,
  determinism and default-dtype settings (:func:`compile_key`);
* every source file the trace went through (the model's code, transformers', ours) hashes as
  it did when the file was written;
* the guards written with it hold for the call: the shape, dtype and layout of every tensor
  (the model's weights included) and every plain value the trace read off the arguments.

A step is loaded only from a folder and file that belong to the current user and that no one
else can write (a saved step is code that runs); otherwise it compiles afresh, with one warning
naming the path and why. ``CUDAGRAPHS_SAVED_STEPS_DIR`` chooses the folder.

A step that cannot be compiled this way (a graph break, a guard that cannot be written, a
torch without ``aot_compile``) is compiled by ``torch.compile`` as before; the reason is kept
in :attr:`SavedCompile.not_saved`. A trace that failed is remembered beside the entries, so
that a later process compiles such a step once instead of tracing it twice. ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` turns saving off.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from ..core import compat, math_settings
from ..errors import Notices

__all__ = [
    "FOLDER_VARIABLE",
    "SavedCompile",
    "compile_key",
    "saved_steps_folder",
    "untrusted",
    "write_whole",
]


def compile_key(model: Any, fn: Callable[..., Any], settings: dict[str, Any], *extra: Any) -> str:
    """The hash that names the saved compile of ``fn`` for ``model`` (see the module doc);
    ``extra``: whatever else the caller's trace depends on (its dynamic dimensions' bounds)."""
    import transformers

    device = next(model.parameters()).device
    gpu = (
        [torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)]
        if device.type == "cuda"
        else device.type
    )
    parts = [
        platform.python_version(), torch.__version__, transformers.__version__, _own_version(),
        gpu, f"{type(model).__module__}.{type(model).__qualname__}",
        model.config.to_json_string(use_diff=False), _private_settings(model.config),
        sorted({str(p.dtype) for p in model.parameters()}),
        f"{fn.__module__}.{fn.__qualname__}", repr(sorted((settings["options"] or {}).items())),
        settings["mode"], _cache()[1], sorted(math_settings().items()),
        torch.are_deterministic_algorithms_enabled(),
        str(torch.get_default_dtype()), [repr(e) for e in extra],
        # Module classes: a fused projection's forward differs from nn.Linear's.
        sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}),
    ]  # fmt: skip
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


class SavedCompile:
    """``fn`` compiled once per shape class and saved under ``key`` (:func:`compile_key`); a
    call runs the first saved or compiled entry whose guards hold for it, loads the saved
    ones on the first call, and compiles (and saves) a new entry for a call none fits.

    Right: one per compiled step of a decoder, called as ``fn`` would be.
    Wrong: a key that leaves out something the trace read (a setting, a module's source):
    a file compiled under the old value would be loaded under the new one.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        settings: dict[str, Any],
        *,
        dynamic: bool | None,
        key: str,
        mark: Callable[[tuple[Any, ...]], None] | None = None,
        unsaved: str = "",
        keyed_identities: Collection[str] | None = None,
    ):
        """``settings``: ``torch.compile``'s mode and options (``compiled.compile_settings``);
        ``dynamic``: its ``dynamic`` (``None``: the dimensions ``mark`` marks on a call's
        arguments, ``compat.mark_dynamic``, before a trace); ``unsaved``: why this step is
        not saved (then plain ``torch.compile``, nothing written or read), or ``""``;
        ``keyed_identities``: the importable names of the classes and functions ``key``
        covers (``None``: a key of config and sources, as a decoder's); a trace whose saved
        guards would leave the identity of anything else it read off the arguments unchecked
        (an attribute holding a function ``key`` does not name) is compiled with
        ``torch.compile`` instead."""
        self.fn, self.settings, self.dynamic, self.mark = fn, settings, dynamic, mark
        self.keyed_identities = keyed_identities
        self.folder = saved_steps_folder() / key
        self.entries: list[Any] | None = None  # loaded (or compiled) AOT-compiled functions
        self.fallback: Callable[..., Any] | None = None  # torch.compile, once aot_compile failed
        self.loaded = self.saved = 0
        # Traces that ended in no entry (a guard aot_compile cannot write, such as one on an
        # object of a class defined inside a function); the fallback traces again.
        self.failed_traces = 0
        self.save_s = 0.0  # writing entries (their share of the compile time)
        self.not_saved = ""  # why not, where a step could not be saved
        if unsaved:  # nothing read either: a file another process saved is not used
            self._give_up(unsaved)
            self.entries = []

    def __call__(self, *args: Any) -> Any:
        if self.entries is None:
            self.entries = self._load()
        for entry in self.entries:
            if entry.guard_check(*args):
                return entry(*args)
        if self.fallback is None:
            entry = self._compile(args)
            if entry is not None:
                self.entries.append(entry)
                return entry(*args)
        assert self.fallback is not None
        if self.mark is None:
            return self.fallback(*args)
        self.mark(args)  # for a trace of a new shape class; taken off again, as after a save:
        try:  # an argument handed on to a loaded step (the token) must carry no marks
            return self.fallback(*args)
        finally:
            compat.clear_dynamic_marks(args)

    def _compile(self, args: tuple[Any, ...]) -> Any:
        """A new entry traced on ``args`` and saved; ``None`` (and the fallback set) where
        that cannot be done. The marks are taken off again after the trace: a loaded
        entry's guards ask that a tensor carry none (torch 2.11 writes its guard on the marks
        from an unmarked copy of the example), and the graphs' buffers are called again."""
        if self.mark is not None:
            self.mark(args)
        aot_compile = None
        try:
            aot_compile = compat.aot_compiler(
                self.fn, self.settings, self.dynamic, keyed=self.keyed_identities
            )
            if aot_compile is None:
                raise RuntimeError("this torch has no aot_compile")
            entry = aot_compile((args, {}))
        except Exception as error:  # a graph break, a guard it cannot write: compile as before
            self._give_up(f"{type(error).__name__}: {str(error)[:300]}")
            if aot_compile is not None:  # the trace itself failed: the next process skips it
                self.failed_traces += 1
                self._remember_unsaved()
            return None
        finally:
            compat.clear_dynamic_marks(args)
        start = time.perf_counter()
        try:
            self._save(entry)
        except Exception as error:  # a read-only disk: this process still runs the entry
            self.not_saved = f"{type(error).__name__}: {str(error)[:300]}"
        self.save_s += time.perf_counter() - start
        return entry

    def _give_up(self, reason: str) -> None:
        self.not_saved = reason
        self.fallback = torch.compile(self.fn, dynamic=self.dynamic, **self.settings)

    def _writable_folder(self) -> Path:
        if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1":
            raise RuntimeError("TORCHINDUCTOR_FORCE_DISABLE_CACHES=1")
        self.folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.folder.mkdir(mode=0o700, exist_ok=True)
        if why := untrusted(self.folder.parent) or untrusted(self.folder):
            raise PermissionError(f"{self.folder}: {why}")  # nothing written where others write
        return self.folder

    def _remember_unsaved(self) -> None:
        """Note beside the entries that a trace of this step could not be saved: a later
        process with the same key (versions, config, settings) compiles with ``torch.compile``
        at once instead of tracing twice. Delete the folder to try again."""
        with contextlib.suppress(Exception):  # a read-only disk: the next process tries again
            write_whole(self._writable_folder() / UNSAVED, self.not_saved.encode())

    def _save(self, entry: Any) -> None:
        self._writable_folder()
        name = f"entry-{len(self.entries or [])}-{os.getpid()}"
        data = type(entry).serialize(entry).serialized_data
        sources = _source_hashes({s.module for s in entry.source_info().inlined_sources})
        write_whole(self.folder / f"{name}.bin", data)
        meta = {"sources": sources, **compat.saved_entry_globals(entry, self.fn)}
        write_whole(self.folder / f"{name}.json", json.dumps(meta).encode())
        self.saved += 1

    def _load(self) -> list[Any]:
        """The saved entries whose sources are unchanged; a stale or unreadable one is
        deleted (it is compiled again when a call needs it)."""
        entries: list[Any] = []
        if not self.folder.is_dir():
            return entries
        if why := untrusted(self.folder.parent) or untrusted(self.folder):
            self._refuse(self.folder, why)
            return entries
        for meta in sorted(self.folder.glob("*.json")):
            data = meta.with_suffix(".bin")
            if why := untrusted(meta) or untrusted(data):
                self._refuse(data, why)
                continue
            try:
                written = json.loads(meta.read_text())
                sources = written["sources"]
                if _source_hashes(set(sources)) != sources:
                    raise ValueError("a source file changed")
                # The modules the trace named by made-up globals, and the builtins its code
                # loads as globals, found again by their names.
                named = {
                    g: importlib.import_module(m) for g, m in written.get("modules", {}).items()
                }
                named.update({b: getattr(builtins, b) for b in written.get("builtins", [])})
                with data.open("rb") as file:
                    load = torch.compiler.load_compiled_function
                    entries.append(load(file, f_globals=named) if named else load(file))
                self.loaded += 1
            except Exception:  # stale, torn or from another torch: compile afresh
                meta.unlink(missing_ok=True)
                data.unlink(missing_ok=True)
        unsaved = self.folder / UNSAVED
        if unsaved.is_file() and not untrusted(unsaved):  # a call no entry fits: no aot trace
            self._give_up(f"not saved by an earlier process: {unsaved.read_text()[:300]}")
        return entries

    def _refuse(self, path: Path, why: str) -> None:
        """A saved step runs code: one from a place another user could have written is not
        loaded (the step compiles afresh), with one warning per path and reason."""
        self.not_saved = f"{path}: {why}"
        _NOTICES.warn(
            f"untrusted saved step: {path}: {why}",
            f"cudagraphs: a saved compiled step at {path} is not loaded: {why}. A saved step "
            "is code that runs; the step is compiled afresh instead. Fix: point "
            f"{FOLDER_VARIABLE} at a folder only you can write (chmod 700), or remove that one.",
            stacklevel=4,
        )


FOLDER_VARIABLE = "CUDAGRAPHS_SAVED_STEPS_DIR"
#: Beside a step's entries: why a trace of it could not be saved (see ``_remember_unsaved``).
UNSAVED = "unsaved.reason"
# One per process: the same untrusted path is named once, whichever decoder meets it.
_NOTICES = Notices()


def saved_steps_folder() -> Path:
    """Where compiled steps are saved: ``$CUDAGRAPHS_SAVED_STEPS_DIR``, else a ``cudagraphs``
    folder in Inductor's cache folder (which defaults to one under the system's temporary
    folder, per user)."""
    chosen = os.environ.get(FOLDER_VARIABLE)
    return Path(chosen) if chosen else Path(_cache()[0]) / "cudagraphs"


def untrusted(path: Path) -> str:
    """Why ``path`` may hold what another user wrote ("" where it may not): it belongs to
    someone else, or others may write to it (group- or world-writable), or it is a link."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return ""
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    getuid = getattr(os, "getuid", None)
    if getuid is not None and info.st_uid != getuid():
        return f"it belongs to user id {info.st_uid}, not to you ({getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write to it (mode {stat.filemode(info.st_mode)})"
    return ""


def _private_settings(config: Any) -> dict[str, Any]:
    """The config's private plain values, which its JSON leaves out: the attention and experts
    implementations among them (``_attn_implementation``), which the trace follows."""
    plain = (str, int, float, bool, type(None))
    return {k: v for k, v in sorted(vars(config).items()) if k[:1] == "_" and isinstance(v, plain)}


def _cache() -> tuple[str, str]:
    """``compat.compile_cache()``; where this torch lacks it, a folder no entry is saved in."""
    try:
        return compat.compile_cache()
    except (ImportError, AttributeError):
        return os.devnull, ""


def _own_version() -> str:
    try:
        return importlib.metadata.version("cudagraphs")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "not installed"


def _source_hashes(modules: set[str]) -> dict[str, str]:
    """sha256 of each module's source file ("" where it has none)."""
    hashes = {}
    for name in sorted(modules):
        try:
            path = inspect.getsourcefile(sys.modules.get(name) or importlib.import_module(name))
            hashes[name] = hashlib.sha256(Path(path or "").read_bytes()).hexdigest()
        except (ImportError, OSError, TypeError):
            hashes[name] = ""
    return hashes


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (another process may be reading)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "wb") as file:
        file.write(data)
    os.replace(temporary, path)
