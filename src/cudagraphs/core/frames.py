"""Where the user is (the first frame outside torch and cudagraphs, a callable's name), and
why a capture failed, in words.

Errors, warnings and doctor findings all point at the user's line, never at ours; this module is
the one place that knows which files are "ours". A failed capture is named here too: the kind of failure in a word, what happened, and the
fix.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = [
    "LIBRARY_SETTING",
    "block_hint",
    "callable_name",
    "class_names",
    "classify_failure",
    "failing_module",
    "is_library_file",
    "is_model_class",
    "is_model_code",
    "is_torch_file",
    "library_setting",
    "slot_values",
    "user_frame",
    "user_location",
    "user_stacklevel",
]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_LIBRARY_DIRS = (
    _PACKAGE_DIR,
    _TORCH_DIR,
    os.path.dirname(os.path.abspath(optree.__file__)),
    os.path.dirname(os.path.abspath(warnings.__file__)),
)


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` is code of torch, this library, optree or Python's own folder
    (which holds the installed packages too): not the user's."""
    return "<frozen" in filename or os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def is_torch_file(filename: str) -> bool:
    """Whether ``filename`` is part of the installed torch."""
    return filename.startswith(_TORCH_DIR)


def is_model_code(filename: str) -> bool:
    """Whether ``filename`` is code whose plain reads decide what a model computes: the
    user's, or an installed package's (transformers' model code), not torch's, this library's,
    optree's or the standard library's."""
    path = os.path.abspath(filename)
    if "<frozen" in filename or path.startswith(_LIBRARY_DIRS[:3]):
        return False
    return not path.startswith(_LIBRARY_DIRS[3]) or "-packages" + os.sep in path


@functools.cache
def class_names(cls: type) -> frozenset[str]:
    """The names the methods of ``cls`` load (its own, its bases' below ``nn.Module`` itself,
    the code a decorated one wraps, the functions nested in them): ``self.training``,
    ``self.eps``. Construction and description are not computation: ``__init__`` and the other
    dunder methods, ``extra_repr`` and ``reset_parameters`` are left out."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            break
        for key, member in vars(klass).items():
            if key.startswith("__") or key in ("extra_repr", "reset_parameters"):
                continue
            function = getattr(member, "__func__", member)
            codes = [getattr(function, "__code__", None)]
            for _ in range(8):  # a decorated method: the code it wraps too
                function = getattr(function, "__wrapped__", None)
                codes.append(getattr(function, "__code__", None))
            codes = [c for c in codes if c is not None]
            while codes:
                code = codes.pop()
                names.update(code.co_names)
                codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return frozenset(names)


def callable_name(fn: Callable[..., Any]) -> str:
    """``Name()`` for messages: a function's qualified name, or a module's class name."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{name}()"


def user_frame(frame: types.FrameType | None = None) -> tuple[str, int]:
    """``(filename, line)`` of the innermost frame on the stack that is the user's code."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        if not is_library_file(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def user_location(error: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of user code in ``error``'s traceback."""
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if not is_library_file(frame.filename):
            found = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return found


def failing_module(error: BaseException, top: Any = None) -> Any:
    """The innermost ``nn.Module`` (other than ``top``) whose ``forward`` is on ``error``'s
    traceback: the block to name when a step inside a third-party model cannot be recorded."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if (
            isinstance(owner, torch.nn.Module)
            and owner is not top
            and frame.f_code.co_name == "forward"
        ):
            found = owner
        tb = tb.tb_next
    return found


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside cudagraphs."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


# Ordered: the first pattern found in the error chain (primary error first) decides the kind.
_FAILURES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (
        "nested-capture",
        ("captures_underway", "already capturing", "cudagraph trees", "cudagraphify"),
        "the function itself starts a CUDA graph capture (for example a torch.compile "
        "model with mode='reduce-overhead', which records its own graphs)",
        "compile with mode='default' or mode='max-autotune-no-cudagraphs' and let cudagraphs "
        "do the capture",
    ),
    (
        "cpu-tensor",
        ("cannot copy between cpu and cuda", "pinned", "expected all tensors to be on the same"),
        "a CPU tensor was used inside the captured region (a host-to-device copy, or a CPU "
        "tensor mixed into a CUDA op); its value would be frozen at capture",
        "create the tensor on the GPU once, outside the function, and pass it in as an input "
        "(or keep it as a module buffer); a step that must stay as it is can run eagerly "
        "between two graphs: mark its function with @cg.eager, or pass eager=[ItsModule]",
    ),
    (
        "host-sync",
        (
            "operation not permitted when stream is capturing",
            "cudaerrorstreamcaptureunsupported",
            "not supported during cuda graph capture",
            "synchroniz",
        ),
        "the function synchronized with the host while being recorded: .item(), .tolist(), "
        ".cpu(), .numpy(), print(tensor), `if tensor:`, torch.cuda.synchronize(), or an op "
        "whose output shape depends on data (nonzero, boolean-mask indexing, unique)",
        "keep values on the GPU: torch.where(cond, a, b) instead of `if`, fixed-size masks "
        "instead of boolean indexing, and move logging/.item() outside the graphed function "
        "(cg.doctor(fn, *args) lists each such line); or let that step run eagerly between "
        "two graphs: mark its function with @cg.eager, or pass eager=[ItsModule]",
    ),
    (
        "default-stream",
        ("cudaerrorstreamcaptureimplicit", "legacy stream", "implicit"),
        "work was sent to the legacy default stream while another stream was capturing",
        "run all work of the function on the current stream; avoid torch.cuda.default_stream()",
    ),
    (
        "out-of-memory",
        ("out of memory",),
        "the GPU ran out of memory while recording",
        "free memory before capture, use a smaller example, or share a pool between graphs",
    ),
    (
        "illegal-access",
        ("illegal memory access", "misaligned address", "device-side assert"),
        "a kernel faulted; CUDA errors of this kind poison the whole process",
        "run the function eagerly with CUDA_LAUNCH_BLOCKING=1 to find the faulting kernel, "
        "then restart the process",
    ),
    (
        "invalidated",
        ("cudaerrorstreamcaptureinvalidated", "capture invalidated", "invalidated"),
        "an earlier operation invalidated the capture (often a host sync or a CPU copy)",
        "run cg.doctor(fn, *args) to find the operation that cannot be recorded",
    ),
)


def classify_failure(
    error: BaseException, end_error: BaseException | None = None
) -> tuple[str, str, str]:
    """Name a capture failure: ``(kind, what happened in plain words, how to fix it)``."""
    texts = []
    seen: BaseException | None = error
    while seen is not None and len(texts) < 8:
        texts.append(f"{type(seen).__name__}: {seen}".lower())
        seen = seen.__cause__ or seen.__context__
    if end_error is not None:
        texts.append(str(end_error).lower())
    for text in texts:
        for kind, needles, what, fix in _FAILURES:
            if any(needle in text for needle in needles):
                return kind, what, fix
    return (
        "error",
        "the function raised while being recorded, although it ran eagerly during warm-up "
        "(does it behave differently while torch.cuda.is_current_stream_capturing()?)",
        "fix the error shown below, or pass fallback='eager' to run this function eagerly",
    )


def block_hint(module: Any) -> str:
    """Name the block the failure happened in, for ``eager=[...]`` (and a library setting that
    removes the host read, where one is known)."""
    if module is None:
        return ""
    name = type(module).__name__
    hint = f". The step is inside {name}: eager=[{name}] runs that block eagerly"
    if type(module).__module__.startswith("transformers.") and _is_moe(name):
        hint += "; or " + LIBRARY_SETTING
    return hint


#: The known library setting that removes a host read (transformers' MoE experts).
LIBRARY_SETTING = (
    "remove the host read so the whole model is one graph: bf16 weights (native grouped "
    "matmul), or transformers' experts_implementation='batched_mm' "
    "(config._experts_implementation), which copies an expert's weights for every token and "
    "choice and so can be slower than eager with many tokens per call: time it"
)


def _is_moe(text: str) -> bool:
    text = text.lower()
    return "experts" in text or "moe" in text


def library_setting(location: str) -> str | None:
    """The setting that removes a break at ``location`` (a ``file:line``, or a block's name),
    where one is known: a host read inside transformers' mixture-of-experts code."""
    if "transformers" in location and _is_moe(location):
        return LIBRARY_SETTING
    return None


_MODEL_CLASSES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def is_model_class(cls: type) -> bool:
    """Whether ``cls`` is defined in model code (the user's, or an installed package's model
    code such as transformers'), not in torch, this library or the standard library. Decided
    once per class: the walk and the value guards ask for every object they meet."""
    known = _MODEL_CLASSES.get(cls)
    if known is None:
        module = sys.modules.get(getattr(cls, "__module__", None) or "")
        filename = getattr(module, "__file__", None)
        known = filename is not None and is_model_code(filename)
        with contextlib.suppress(TypeError):  # no weak reference: decided again next time
            _MODEL_CLASSES[cls] = known
    return known


def slot_values(obj: Any) -> dict[str, Any]:
    """What an object of model code's classes holds in ``__slots__`` (``@dataclass(slots=True)``
    has no ``__dict__``), by name; empty for other objects and unset slots."""
    if not is_model_class(type(obj)):
        return {}
    found: dict[str, Any] = {}
    for klass in type(obj).__mro__:
        names = getattr(klass, "__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found.setdefault(name, getattr(obj, name))
    return found
