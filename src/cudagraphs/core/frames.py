"""Where the user is: the first frame outside torch and cudagraphs, and a callable's name.

Errors, warnings and doctor findings all point at the user's line, never at ours; this module is
the one place that knows which files are "ours".
"""

from __future__ import annotations

import os
import sys
import traceback
import types
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = [
    "callable_name",
    "failing_module",
    "is_library_file",
    "is_model_code",
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


def is_model_code(filename: str) -> bool:
    """Whether ``filename`` is code whose plain reads decide what a model computes: the
    user's, or an installed package's (transformers' model code), not torch's, this library's,
    optree's or the standard library's."""
    path = os.path.abspath(filename)
    if "<frozen" in filename or path.startswith(_LIBRARY_DIRS[:3]):
        return False
    return not path.startswith(_LIBRARY_DIRS[3]) or "-packages" + os.sep in path


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
