"""One call that says whether a list of tensors still lives at the recorded addresses.

The address guard runs this before every replay, so its cost is paid per call. Three ways, the
fastest that works is used:

1. ``compiled``: a 40-line C++ loop, built on first use with the system C++ compiler against
   ``Python.h`` only (about a second, then cached). It reads each address through the function
   pointer that PyTorch itself exports for Inductor's C++ wrapper
   (``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr``), so no PyTorch headers
   are needed and no Python objects are made per tensor: a few ns per tensor.
2. ``torch helper``: ``torch._C._tensors_data_ptrs_at_indices_equal`` (CUDA builds), which
   cudagraph trees use; pybind11 converts every element, about 80 ns per tensor on a slow host.
3. ``python loop``: ``t.data_ptr()`` per tensor, about 110 ns per tensor.

Set ``CUDAGRAPHS_NO_COMPILE=1`` to skip building (2 or 3 is used); ``CUDAGRAPHS_CACHE_DIR``
chooses where the built module is kept (default ``~/.cache/cudagraphs``, else a folder in the
temporary directory).
"""

from __future__ import annotations

import array
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["AddressCheck", "compiled_module"]

log = logging.getLogger("cudagraphs")

# Our own loop. Exceptions from PyTorch's reader (a non-tensor, a tensor without storage) are
# caught and answered "moved": the caller then finds the culprit with Tensor.data_ptr(), which
# raises a proper Python error. No C++ exception may cross into the interpreter.
_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>
#include <cstring>

typedef void* (*read_fn)(PyObject*);
static read_fn read_address = nullptr;

static PyObject* bind(PyObject*, PyObject* address) {
  unsigned long long value = PyLong_AsUnsignedLongLong(address);
  if (value == (unsigned long long)-1 && PyErr_Occurred()) return nullptr;
  read_address = reinterpret_cast<read_fn>(static_cast<uintptr_t>(value));
  Py_RETURN_NONE;
}

// same(tensors: tuple, addresses: bytes of uint64) -> bool
static PyObject* same(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[0]) || !PyBytes_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "same(tensors: tuple, addresses: bytes)");
    return nullptr;
  }
  if (read_address == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
    return nullptr;
  }
  PyObject* tensors = args[0];
  Py_ssize_t n = PyTuple_GET_SIZE(tensors);
  if (PyBytes_GET_SIZE(args[1]) != n * (Py_ssize_t)sizeof(uint64_t)) {
    PyErr_SetString(PyExc_ValueError, "one 8-byte address per tensor expected");
    return nullptr;
  }
  const char* expected = PyBytes_AS_STRING(args[1]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    void* now;
    try {
      now = read_address(PyTuple_GET_ITEM(tensors, i));
    } catch (...) {
      Py_RETURN_FALSE;
    }
    uint64_t want;
    std::memcpy(&want, expected + i * sizeof(uint64_t), sizeof(uint64_t));
    if (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(now)) != want) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
  {"bind", bind, METH_O, "Set the address reader."},
  {"same", (PyCFunction)(void (*)(void))same, METH_FASTCALL, "All tensors at the addresses?"},
  {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_MODULE_NAME(void) { return PyModule_Create(&module); }
"""

_READER = "_torchinductor_pyobject_tensor_data_ptr"
_module: Any = None
_failure: str | None = None


def _cache_dir() -> Path:
    chosen = os.environ.get("CUDAGRAPHS_CACHE_DIR")
    if chosen:
        return Path(chosen)
    home = Path.home() / ".cache" / "cudagraphs"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:  # a read-only home (containers, CI sandboxes)
        user = getattr(os, "getuid", lambda: "user")()  # no getuid on Windows
        return Path(tempfile.gettempdir()) / f"cudagraphs-{user}"


def _build(name: str, target: Path) -> None:
    """Compile ``_SOURCE`` into ``target``; write to a temporary name and rename, so a
    concurrent process never loads a half-written file."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler found (set CXX, or install g++)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"Python.h not found in {include} (install the Python development headers)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / f"{name}.cpp"
        source.write_text(_SOURCE.replace("MODULE_NAME", name))
        built = Path(tmp) / target.name
        command = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", f"-I{include}"]
        result = subprocess.run(
            [*command, str(source), "-o", str(built)], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {result.stderr.strip()[-400:]}")
        os.replace(built, target)


def compiled_module() -> Any:
    """The compiled checker, built on first use; ``None`` (reason logged once) if unavailable."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    try:
        if os.environ.get("CUDAGRAPHS_NO_COMPILE"):
            raise OSError("CUDAGRAPHS_NO_COMPILE is set")
        reader = getattr(torch._C._dynamo.guards, _READER, None)
        if not isinstance(reader, int):
            raise OSError(f"this PyTorch does not export {_READER}")
        digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
        name = f"_cudagraphs_addresses_{digest}"
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        target = _cache_dir() / f"{name}{suffix}"
        if not target.exists():
            _build(name, target)
        spec = importlib.util.spec_from_file_location(name, target)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.bind(reader)
        _module = module
    except (OSError, ImportError, subprocess.SubprocessError) as error:
        _failure = str(error)
        log.info("cudagraphs: compiled address check unavailable (%s); using a fallback", error)
    return _module


class AddressCheck:
    """``check()`` is True while every tensor still has the data pointer it had at construction.

    Right::

        check = AddressCheck(list(model.parameters()))
        ...
        if not check():          # one C call, about 10 ns per tensor when compiled
            recapture()

    Wrong: ``[p.data_ptr() for p in params] == saved`` before every replay: about 110 ns per
    tensor, 11 µs for a 100-parameter model.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, native: bool = True):
        self.tensors = tuple(tensors)
        self.ptrs = [t.data_ptr() for t in self.tensors]
        module = compiled_module() if native and self.tensors else None
        # ``unchanged`` is a C-level partial where possible: no Python frame per check.
        self.unchanged: Callable[[], bool]
        if not self.tensors:
            self.unchanged = lambda: True
            self.backend = ""
        elif module is not None:
            packed = array.array("Q", self.ptrs).tobytes()
            self.unchanged = functools.partial(module.same, self.tensors, packed)
            self.backend = "compiled"
        elif hasattr(torch._C, "_tensors_data_ptrs_at_indices_equal"):
            equal = torch._C._tensors_data_ptrs_at_indices_equal
            indices = list(range(len(self.tensors)))
            self.unchanged = functools.partial(equal, list(self.tensors), self.ptrs, indices)
            self.backend = "torch helper"
        else:
            self.unchanged = lambda: [t.data_ptr() for t in self.tensors] == self.ptrs
            self.backend = "python loop"

    def __call__(self) -> bool:
        return self.unchanged()

    def moved(self) -> list[int]:
        """Indices of the tensors whose data pointer changed, or that no longer have one (a
        parameter swapped for a sparse or storage-less tensor): the slow, exact answer."""
        return [i for i, (t, p) in enumerate(zip(self.tensors, self.ptrs)) if _address(t) != p]


def _address(t: torch.Tensor) -> int | None:
    try:
        return t.data_ptr()
    except RuntimeError:  # no storage to point at
        return None
