"""Reads that the names of the recorded code do not show, found in its bytecode and its calls.

The value guard keeps what the recording's code loads by name (``python_values``). Some reads
name nothing the guard can match: ``getattr(self, f"w{i}")`` builds the attribute's name at run
time, ``self.ws[key]`` reads a dict under a key held in a variable, and ``torch.get_num_threads()``
reads a host setting through a call. This module says, per code object, whether its bytecode
makes such reads (:func:`computed_reads`), which host-setting getters a run called
(:data:`HOST_GETTERS`, noted by ``python_values.Reader`` from the profiler's C-call events),
which environment variables it read (:data:`ENVIRON_READ`: guarded like a host setting,
through :func:`environment_getter`; :func:`environment_keys` where the code is compiled),
which clocks it read (:data:`CLOCKS`: a result no guard can compare, so the capture is
refused), and where a name is read (:func:`where_read`, for errors that name the user's line).

Right::

    def forward(self, x):
        return x * getattr(self, f"w{self.index}")   # every plain attribute of self guarded

Wrong (nothing to see: a value the code reaches through no object it holds)::

    def forward(self, x):
        return x * lookup_in_a_database()            # a host call's result: pass a tensor
"""

from __future__ import annotations

import dis
import functools
import os
import re
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLOCKS",
    "ENVIRON_READ",
    "ENVIRON_WRAPPERS",
    "HOST_GETTERS",
    "ComputedReads",
    "computed_reads",
    "environment_getter",
    "environment_keys",
    "host_getter",
    "host_getter_label",
    "is_environment_getter",
    "where_read",
]

# The builtins that read an attribute under a name given as a value.
_BY_NAME = frozenset({"getattr", "hasattr", "vars"})
_CALLS = frozenset({"CALL", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_KW", "CALL_FUNCTION_EX"})
_SUBSCRIPTS = frozenset({"BINARY_SUBSCR"})
_CONSTANT_LOADS = frozenset({"LOAD_CONST", "LOAD_SMALL_INT"})


@dataclass(frozen=True)
class ComputedReads:
    """What one code object reads under names or keys computed at run time."""

    #: ``getattr(obj, name)`` / ``hasattr`` / ``vars(obj)`` with a name that is not a constant.
    attributes: bool
    #: ``container[key]`` or ``container.get(key)`` with a key that is not a constant.
    items: bool


@functools.lru_cache(maxsize=4096)
def computed_reads(code: types.CodeType) -> ComputedReads:
    """Whether ``code`` reads attributes or items under names computed at run time. Read from
    its bytecode once per code object: a call of ``getattr``/``hasattr`` whose name argument is
    not a constant (the instruction that pushes it is not a constant load), ``vars(...)``, or a
    subscript or ``.get`` whose key is not a constant."""
    instructions = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "PRECALL")]
    attributes = items = False
    for index, instruction in enumerate(instructions):
        name = instruction.argval if isinstance(instruction.argval, str) else None
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and name in _BY_NAME:
            attributes = attributes or _computed_name_argument(instructions, index, name)
        elif instruction.opname in _SUBSCRIPTS:
            before = instructions[index - 1] if index else None
            items = items or before is None or before.opname not in _CONSTANT_LOADS
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and name == "get":
            items = items or _computed_name_argument(instructions, index, "get")
    return ComputedReads(attributes, items)


def _computed_name_argument(instructions: list[dis.Instruction], start: int, name: str) -> bool:
    """Whether the call that the load at ``start`` begins passes a computed name: the next call
    instruction, with the name as the last argument (2 for ``getattr``/``hasattr``, 1 for
    ``.get``) or the one before a one-instruction default. ``vars`` always counts."""
    if name == "vars":
        return True
    for end in range(start + 1, min(start + 40, len(instructions))):
        if instructions[end].opname in _CALLS:
            break
    else:
        return True
    arguments = instructions[start + 1 : end]
    if instructions[end].opname not in ("CALL", "CALL_FUNCTION") or len(arguments) < 2:
        return True
    count = instructions[end].arg or 0
    wanted = 1 if name == "get" else 2
    last = arguments[-1] if count == wanted else arguments[-2] if count == wanted + 1 else None
    return last is None or last.opname not in _CONSTANT_LOADS or not isinstance(last.argval, str)


@functools.lru_cache(maxsize=1)
def _getters() -> dict[Any, tuple[Any, str]]:
    """``{what the profiler sees: (the getter to call again, how a user writes the setting)}``:
    torch's public zero-argument getters (a C function, seen by its ``c_call`` event, or a
    Python function, seen by its code object's ``call``), and the C getter behind each flag
    property of ``torch.backends``' modules (the property runs it, so the profiler sees it)."""
    import torch.backends.cuda
    import torch.backends.cudnn
    import torch.backends.mkldnn

    public = {
        "torch.get_num_threads()": torch.get_num_threads,
        "torch.get_num_interop_threads()": torch.get_num_interop_threads,
        "torch.get_default_dtype()": torch.get_default_dtype,
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled,
    }
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled",
                 "cudnn_sdp_enabled"):  # fmt: skip
        function = vars(torch.backends.cuda).get(name)
        if callable(function):
            public[f"torch.backends.cuda.{name}()"] = function
    found: dict[Any, tuple[Any, str]] = {
        getattr(function, "__code__", function): (function, label)
        for label, function in public.items()
    }
    for module in (torch.backends.mkldnn, torch.backends.cudnn):
        for name, prop in vars(type(module)).items():
            getter = getattr(prop, "getter", None)
            if isinstance(getter, types.BuiltinFunctionType):
                found[getter] = (getter, f"{module.__name__}.{name}")
    return found


class _Getters:
    """The host-setting getters: what a branch on ``torch.get_num_threads()`` or
    ``torch.backends.mkldnn.enabled`` read, as the profiler sees their calls."""

    def __contains__(self, seen: Any) -> bool:
        try:
            return seen in _getters()
        except TypeError:  # an unhashable callable
            return False


#: Membership test for what the profiler sees of a host-setting getter's call.
HOST_GETTERS = _Getters()


def host_getter(seen: Any) -> Any:
    """The callable to call again before each replay for a getter the profiler saw."""
    return _getters()[seen][0]


def host_getter_label(seen: Any) -> str:
    """How a user writes the setting a seen getter reads (``torch.get_num_threads()``)."""
    return _getters()[seen][1]


#: What the profiler sees of a read of the environment: the code of ``os.environ[key]``, which
#: ``os.environ.get`` and ``os.getenv`` run too (transformers' SDPA attention reads one per
#: layer to pick its grouped path).
ENVIRON_READ = type(os.environ).__getitem__.__code__
#: The files of the standard library's wrappers around that read (frozen modules, named so).
ENVIRON_WRAPPERS = frozenset({ENVIRON_READ.co_filename, Mapping.get.__code__.co_filename})


#: How an environment variable's name is written (a constant of the code, or a module global).
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def environment_keys(codes: Mapping[types.CodeType, Mapping[str, Any]]) -> set[str]:
    """The environment variables ``codes`` (code objects with their module globals) may read,
    from their bytecode: for each code that names ``environ`` or ``getenv``, every string
    constant and every string module global it loads that reads as a variable's name
    (``os.environ.get(SCALE_VARIABLE)``). For code that stands in for what runs, where the
    profiler sees no read: under ``torch.compile`` Dynamo reads the variable from its own
    frames while it traces. Guarding a name the code does not read costs a recapture when it
    changes, never a wrong answer; a name built at run time is not found."""
    keys: set[str] = set()
    for code, namespace in codes.items():
        if "environ" not in code.co_names and "getenv" not in code.co_names:
            continue
        loaded = [c for c in code.co_consts if isinstance(c, str)]
        loaded += [v for n in code.co_names if isinstance(v := namespace.get(n), str)]
        keys.update(k for k in loaded if _VARIABLE_NAME.fullmatch(k))
    return keys


def environment_getter(key: str) -> Any:
    """What a guard calls before each replay for an environment variable the recording read:
    its value now, or None where it is unset."""
    return functools.partial(os.environ.get, key)


def is_environment_getter(owner: Any) -> bool:
    """Whether ``owner`` (a watched value's owner) is an :func:`environment_getter`."""
    return isinstance(owner, functools.partial) and owner.func == os.environ.get


#: The clocks, as the profiler sees their C calls, and how a user writes each: a result that
#: differs on every call, which a graph would freeze at its capture's value.
CLOCKS: dict[Any, str] = {
    getattr(time, name): f"time.{name}()"
    for name in (
        "time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
        "process_time", "process_time_ns",
    )
}  # fmt: skip


def where_read(codes: Any, name: str) -> str:
    """``file:line`` of the first instruction among ``codes`` that loads ``name`` (an attribute
    or global), or of the first code object that names it; ``"?"`` when none does."""
    for code in codes:
        if name not in code.co_names:
            continue
        for instruction in dis.get_instructions(code):
            if instruction.argval == name and instruction.opname.startswith(("LOAD", "BINARY")):
                line = instruction.positions.lineno if instruction.positions else None
                return f"{code.co_filename}:{line or code.co_firstlineno}"
        return f"{code.co_filename}:{code.co_firstlineno}"
    return "?"
