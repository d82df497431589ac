"""A request's prompt through the model (the prefill): recorded per (batch rung, prompt-length
rung), or eager.

Run eagerly, a prefill launches every operator of every layer from Python: for a short prompt
it is bound by the host, not the GPU (``reports/gpu.md``, "decode": whole requests with the
prefill recorded, against the tree before, which prefilled eagerly). So the
:class:`~.transformers.Decoder` records it too: one graph per batch rung and prompt-length rung
(powers of two from 16 to 256 by default), captured on the first request that needs it, in the
decoder's memory pool. A prompt of ``p``
tokens runs on the graph of the shortest rung ``P >= p``, right-padded to ``P``:

- the padding comes after every real token, so under the causal mask no real token attends to
  it; its keys and values land in cache positions ``[p, P)``, which the decode steps overwrite
  (position ``p`` first) before any step attends to them;
- the logits are computed for the last real position only (the model's ``logits_to_keep``,
  given as a device index), and every layer's write position is set back to ``p``;
- the mask is a prepared causal 4-D mask, which SDPA takes as given: without one, transformers
  decides whether it may skip the mask by reading the cache's position on the host, which a
  recording cannot do.

Eager, as before: prompts longer than the longest rung, left-padded prompts (their mask and
position ids are per row), models whose forward has no ``logits_to_keep`` or whose attention is
not SDPA, rungs longer than a sliding window (the prepared mask would let a layer see past its
window), decoders with eager steps (``eager=``), and ``prefill_lengths=[]``.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..api import graph
from ..core import compat
from ..errors import CudaGraphsError, CudaGraphsWarning
from .grouped_attention import takes_sdpa_mask
from .kv_cache import checked_rungs
from .sampling import stop_finished

__all__ = ["Prefills", "prefill_lengths", "run_prefill"]

_LONGEST_DEFAULT = 256  # longer prompts are compute-bound: a recording saves little


def prefill_lengths(cache_len: int, given: Sequence[int] | None) -> list[int]:
    """The prompt-length rungs: ``given``, else powers of two from 16 up to 256 below the
    cache's length, and the length itself where it is at most 256."""
    if given is not None:
        return checked_rungs(
            "prefill_lengths", given, cache_len,
            "a prompt of up to that many tokens is prefilled by one recorded graph",
            "pass e.g. prefill_lengths=[32, 128], [] to prefill eagerly, or leave it out",
        )  # fmt: skip
    rungs = [1 << k for k in range(4, 9) if 1 << k < cache_len]
    return rungs + ([cache_len] if cache_len <= _LONGEST_DEFAULT else [])


def _why_eager(decoder: Any) -> str | None:
    """Why ``decoder``'s prefills cannot be recorded at all, or ``None``."""
    model = decoder.model
    if decoder.eager:
        return "the decoder runs eager steps (eager=...)"
    if not takes_sdpa_mask(model):
        return "the model's attention is not SDPA (a prepared boolean mask is SDPA's input)"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return (
            "the model's forward has no logits_to_keep (it would compute every position's logits)"
        )
    return None


class Prefills:
    """The recorded prefills of one decoder, captured on first use; see the module doc."""

    def __init__(self, decoder: Any, lengths: list[int]):
        self.decoder = decoder
        self.why_eager = _why_eager(decoder)
        window = getattr(decoder.model.config, "sliding_window", None)
        fits = [p for p in lengths if not isinstance(window, int) or p <= window]
        self.lengths = [] if self.why_eager else fits
        self.graphs: dict[tuple[int, int], Any] = {}

    def logits(self, prompt: torch.Tensor) -> torch.Tensor | None:
        """The last real position's logits (``[n, vocab]``) of ``prompt`` (``[n, p]``, every
        row a prompt: the batch rung's rows) through its recorded graph, which leaves the cache
        as the eager prefill would; ``None`` where it prefills eagerly."""
        n, p = prompt.shape
        rung = next((r for r in self.lengths if r >= p), None)
        if rung is None:
            return None
        recorded = self.graphs.get((n, rung)) or self._capture(n, rung)
        if recorded is None:
            return None
        ids, last, real = recorded.inputs
        ids[:, :p].copy_(prompt)
        ids[:, p:].zero_()  # any valid token: no real token attends to the padding
        last.fill_(p - 1)
        real.fill_(p)
        replays, key = self.decoder.stats.prefill_replays, _key(n, rung)
        replays[key] = replays.get(key, 0) + 1
        return recorded(*recorded.inputs)

    def _capture(self, n: int, rung: int) -> Any:
        decoder = self.decoder
        device, cuda = decoder.device, decoder.device.type == "cuda"
        before = torch.cuda.memory_reserved(device) if cuda else 0
        start = time.perf_counter()
        try:
            recorded = _record(decoder, n, rung)
        except CudaGraphsError as error:  # the eager prefill is as right, only slower
            warnings.warn(
                f"cudagraphs: the Decoder's prefill could not be recorded, so prompts are "
                f"prefilled eagerly: {str(error).splitlines()[0]}",
                CudaGraphsWarning,
                stacklevel=4,
            )
            self.lengths = []
            return None
        decoder.stats.prefill_capture_s[_key(n, rung)] = time.perf_counter() - start
        if cuda:
            decoder.stats.graph_bytes += torch.cuda.memory_reserved(device) - before
        self.graphs[n, rung] = recorded
        return recorded


def _key(n: int, rung: int) -> str:
    """The name of a prefill graph in the decoder's statistics."""
    return f"prefill batch {n} length {rung}"


def _record(decoder: Any, n: int, rung: int) -> Any:
    """Capture the prefill of ``rung`` positions on batch rung ``n``: inputs the padded ids,
    the last real position and the real length; output that position's logits."""
    model, device, arg = decoder.model, decoder.device, decoder.cache_arg
    length = next(size for size in decoder.lengths if size >= rung)  # the view it attends to
    cache, whole = decoder.caches[n, length], decoder.caches[n]
    counters = [
        layer.cumulative_length
        for layer in cache.layers
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
    ]
    positions = torch.arange(rung, device=device)
    causal = torch.ones(rung, length, dtype=torch.bool, device=device).tril()[None, None]

    def prefill(ids: torch.Tensor, last: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        whole.reset()  # every position of the batch rung's rows, as the eager prefill resets
        out = model(
            input_ids=ids,
            cache_position=positions,
            attention_mask=causal,
            logits_to_keep=last,
            use_cache=True,
            **{arg: cache},
        )
        if counters:  # the layers wrote `rung` positions; the next write is at `real`
            compat.foreach_copy(counters, [real] * len(counters))
        return out.logits[:, -1, :]

    prefill.__qualname__ = prefill.__name__ = f"prefill_batch{n}_length{rung}"
    ids = torch.zeros(n, rung, dtype=torch.long, device=device)
    last = torch.zeros(1, dtype=torch.long, device=device)
    real = torch.ones((), dtype=torch.long, device=device)
    with torch.no_grad():
        return graph(
            prefill, ids, last, real, pool=decoder.pool, warmup=decoder.warmup,
            modules=[model], side_effects="keep", outputs="alias",
        )  # fmt: skip


def run_prefill(
    decoder: Any,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None,
    n: int,
    mode: str,
    eos: list[int],
    pad: int,
    token: torch.Tensor,
    position: torch.Tensor,
    finished: torch.Tensor,
) -> None:
    """Prefill a request of ``input_ids`` (``mask``: its left padding) on batch rung ``n``,
    then set the decode state: the first token chosen, the position, the history."""
    batch, length = input_ids.shape
    # Rows past the batch repeat the first prompt: a valid input whose results are dropped.
    prompt = torch.cat([input_ids, input_ids[:1].expand(n - batch, length)])
    logits = decoder.prefills.logits(prompt) if mask is None else None
    if logits is None:
        logits = _eager(decoder, prompt, mask, n)
    decoder.eos.fill_(-1)
    decoder.eos[: len(eos)] = torch.tensor(eos, dtype=torch.long)
    decoder.pad.fill_(pad)
    finished.zero_()
    finished[batch:] = True
    first = stop_finished(decoder.chooser(mode)(logits), finished, decoder.eos, decoder.pad)
    token.copy_(first)
    position.fill_(length)
    decoder.history[:n, :length] = prompt
    decoder.history[:n, length] = first[:, 0]


def _eager(decoder: Any, prompt: torch.Tensor, mask: torch.Tensor | None, n: int) -> Any:
    length = prompt.shape[1]
    cache = decoder.caches[n]
    cache.reset()
    positions = torch.arange(length, device=decoder.device)
    extra: dict[str, Any] = {}
    if mask is not None:  # as generate does: position ids count real tokens only
        mask = torch.cat([mask, mask[:1].expand(n - mask.shape[0], length)])
        ids = mask.long().cumsum(-1) - 1
        extra = {"attention_mask": mask.long(), "position_ids": ids.masked_fill(~mask, 1)}
        decoder.attends[:n].zero_()
        decoder.attends[:n, 0, 0, :length] = mask
        decoder.padding[:n, 0] = length - mask.sum(-1)
    decoder.stats.eager_prefills += 1
    out = decoder.model(
        input_ids=prompt,
        cache_position=positions,
        use_cache=True,
        **{decoder.cache_arg: cache},
        **extra,
    )
    return out.logits[:, -1, :]
