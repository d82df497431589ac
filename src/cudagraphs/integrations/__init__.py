"""Bridges to other libraries, each imported on first use of a name: ``backend`` (a
``torch.compile`` backend that graphs what Dynamo traces) and saved compiled steps
(``torch.compile``'s ``aot_compile``, written to and loaded from a folder of one's own).
LLM decoding over transformers is :mod:`cudagraphs.decoding`.

Right: ``from cudagraphs.integrations import backend``. Wrong: reaching into
``cudagraphs.integrations.dynamo`` from another package of the library: this module is the
one door."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import first_use

if TYPE_CHECKING:
    from .dynamo import backend
    from .saved_compile import SavedCompile, compile_key, saved_steps_folder, untrusted, write_whole

_WHERE = {
    "SavedCompile": "saved_compile",
    "backend": "dynamo",
    "compile_key": "saved_compile",
    "saved_steps_folder": "saved_compile",
    "untrusted": "saved_compile",
    "write_whole": "saved_compile",
}

__all__ = [
    "SavedCompile",
    "backend",
    "compile_key",
    "saved_steps_folder",
    "untrusted",
    "write_whole",
]


__getattr__ = first_use(__name__, _WHERE)
