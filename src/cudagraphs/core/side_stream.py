"""Eager runs on a capture's side stream, and what they and a recording run under: the one side
stream per device (:func:`default_stream`), autocast without its weight cache
(:func:`uncached_autocast`), the warm-up runs (:func:`warm_up`) and the lazy form's warm-up
calls (:func:`run_on_side_stream`).

Warm-up runs the function a few times on a side stream so that everything lazy happens outside
the recording: the caching allocator grows its blocks, cuBLAS creates its handles and
workspaces, cuDNN and Triton autotune, torch.compile compiles.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["default_stream", "run_on_side_stream", "uncached_autocast", "warm_up"]

_streams: dict[int, torch.cuda.Stream] = {}


def default_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream captures on ``device`` use: one per device, shared by every capture,
    because graphs that share a pool should be captured on the same stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


@contextlib.contextmanager
def uncached_autocast() -> Any:
    """Turn off autocast's weight-cast cache around warm-up and capture.

    Inside an autocast region entered *around* the graphed call, warm-up fills the cache with
    bf16/fp16 copies of the weights and the recording then reads those copies instead of casting:
    replays would never see updated weights, and read freed memory once the region ends. With
    the cache off the casts are recorded and run on every replay. (An autocast region inside the
    function is unaffected: its cache lives and dies within each call.)
    """
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
            yield
    else:
        yield


def run_on_side_stream(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], stream: Any
) -> Any:
    """One eager call on the capture stream, ordered after the caller's work and before what
    follows (no host sync): a warm-up call whose result is the caller's answer."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), uncached_autocast():
        output = fn(*args, **kwargs)
    current.wait_stream(stream)
    return output


def warm_up(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    n: int,
    stream: torch.cuda.Stream,
    *,
    checked: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    after_each: Callable[[], None] | None = None,
) -> float:
    """Run ``fn`` ``n`` times on ``stream``; return the seconds it took (synchronized).
    ``checked()`` is entered around the runs and left before the wait for the GPU: ranks
    compare the collectives the runs issued there, so a rank that issued more raises instead
    of waiting forever for peers that never match them. ``after_each()`` runs after each run
    (the Python-state snapshot)."""
    start = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream())
    with checked(), torch.cuda.stream(stream), uncached_autocast():
        for _ in range(n):
            fn(*args, **kwargs)
            if after_each is not None:
                after_each()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return time.perf_counter() - start
