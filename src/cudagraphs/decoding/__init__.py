"""LLM decoding on graphs: the :class:`Decoder` (transformers models, captured decode steps per
batch and length rung over one static cache), the :class:`Engine` (continuous batching: requests
join and leave a running batch between captured steps, each streamed as a :class:`Completion`),
their sampling settings, and the kernels and model rewrites they use (one-row products, decode
attention, fused projections). Each name loads on first use (transformers and Triton are
optional).

Right: ``from cudagraphs.decoding import Decoder``. Wrong: reaching into
``cudagraphs.decoding.decoder`` from another package of the library: this module is the one
door."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import first_use

if TYPE_CHECKING:
    from .compiled import compile_settings
    from .completions import Completion
    from .decoder import Decoder, DecodeStats
    from .engine import Engine, EngineStats
    from .engine_metrics import EngineMetrics
    from .fused_projections import FusionReport, fuse_projections, unfuse_projections
    from .grouped_attention import grouped_sdpa_attention, use_grouped_attention
    from .kv_cache import default_batch_rungs
    from .sampling import SamplingParams

_WHERE = {
    "Completion": "completions",
    "DecodeStats": "decoder",
    "Decoder": "decoder",
    "Engine": "engine",
    "EngineMetrics": "engine_metrics",
    "EngineStats": "engine",
    "FusionReport": "fused_projections",
    "SamplingParams": "sampling",
    "compile_settings": "compiled",
    "default_batch_rungs": "kv_cache",
    "fuse_projections": "fused_projections",
    "grouped_sdpa_attention": "grouped_attention",
    "unfuse_projections": "fused_projections",
    "use_grouped_attention": "grouped_attention",
}

__all__ = [
    "Completion",
    "DecodeStats",
    "Decoder",
    "Engine",
    "EngineMetrics",
    "EngineStats",
    "FusionReport",
    "SamplingParams",
    "compile_settings",
    "default_batch_rungs",
    "fuse_projections",
    "grouped_sdpa_attention",
    "unfuse_projections",
    "use_grouped_attention",
]


__getattr__ = first_use(__name__, _WHERE)
