"""Integrations with other libraries, each an optional extra imported on first use of a name:
``Decoder`` (LLM decoding with captured decode steps, transformers), ``backend`` (a
``torch.compile`` backend), saved compiled steps, fused projections.

Right: ``from cudagraphs.integrations import Decoder`` (transformers loads then).
Wrong: reaching into ``cudagraphs.integrations.transformers`` from another package of the
library: this module is the one door."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .compiled import compile_settings
    from .dynamo import backend
    from .fused_projections import FusionReport, fuse_projections, unfuse_projections
    from .sampling import SamplingParams
    from .saved_compile import SavedCompile, saved_steps_folder, untrusted, write_whole
    from .transformers import Decoder, DecodeStats, default_batch_rungs

_WHERE = {
    "DecodeStats": "transformers",
    "Decoder": "transformers",
    "FusionReport": "fused_projections",
    "SamplingParams": "sampling",
    "SavedCompile": "saved_compile",
    "backend": "dynamo",
    "compile_settings": "compiled",
    "default_batch_rungs": "transformers",
    "fuse_projections": "fused_projections",
    "saved_steps_folder": "saved_compile",
    "unfuse_projections": "fused_projections",
    "untrusted": "saved_compile",
    "write_whole": "saved_compile",
}

__all__ = [
    "DecodeStats",
    "Decoder",
    "FusionReport",
    "SamplingParams",
    "SavedCompile",
    "backend",
    "compile_settings",
    "default_batch_rungs",
    "fuse_projections",
    "saved_steps_folder",
    "unfuse_projections",
    "untrusted",
    "write_whole",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'cudagraphs.integrations' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
