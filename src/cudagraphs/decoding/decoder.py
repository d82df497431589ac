"""Token-by-token decoding of a transformers causal LM through CUDA graphs.

:class:`Decoder` prepares one ``StaticCache`` sized for the largest batch, prefills each request
eagerly, and decodes with captured graphs: one per batch-size rung and cache-length rung (all in
one memory pool, each on a view of the one cache: a request's launch attends only to the
shortest prefix that holds its positions, and moves to a longer rung as it grows, with nothing
copied), each running ``steps_per_graph`` decode steps per launch with the
next token chosen inside the graph (greedy, or sampled with temperature, top-k and top-p from
the device generator) and fed back on the device. The host replays, and looks at the device
only every ``check_every`` tokens, to stop once every sequence has ended.

Right::

    from cudagraphs.decoding.decoder import Decoder

    decoder = Decoder(model, max_batch=16, max_length=512)     # captures every rung now
    out = decoder.generate(input_ids, max_new_tokens=128)      # == model.generate(...) greedy

Wrong: a decode loop calling ``model(...)`` through ``cg.graph`` with a fresh ``DynamicCache``
per request: the cache grows (new shapes and addresses), so every token would need a capture.

transformers is an optional dependency: the ``transformers`` extra (``pip install -e '.[transformers]'`` from a clone).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import Pool
from ..errors import ConfigError, explain
from ..integrations import SavedCompile
from ..options import check_bool, check_positive_int, checked_keywords
from .compiled import compiled_forward, compiled_tail, mark_rung_dims, step_logits
from .fused_projections import fuse_projections
from .grouped_attention import choose_attention
from .kv_cache import RungCaches, cache_keyword, default_batch_rungs, length_rungs
from .prefill import Prefills, run_prefill
from .prefill import prefill_lengths as prefill_lengths_of
from .requests import (
    MAX_EOS,
    check_attention,
    check_compile,
    check_eager,
    check_model,
    check_request,
    check_until_eos,
    stop_ids,
    trim_finished,
)
from .sampling import SamplingParams, greedy, sample
from .steps import capture_steps, compile_forward, greedy_tail, rewind

__all__ = ["DecodeStats", "Decoder"]


@dataclass
class DecodeStats:
    """What the decoder has done: set-up cost, graphs, replays, recaptures, memory."""

    setup_s: float = 0.0
    compile_s: float = 0.0  # torch.compile: a batch-1 rung and larger batches, every length
    compiles_loaded: int = 0  # compiled steps loaded from disk (saved by an earlier process)
    compiles_saved: int = 0  # compiled steps written to disk for the next process
    compile_not_saved: str = ""  # why a compiled step was not saved (see saved_compile.py)
    compile_save_s: float = 0.0  # of compile_s: writing the compiled steps to disk
    capture_s: dict[str, float] = field(default_factory=dict)
    replays: dict[str, int] = field(default_factory=dict)
    recaptures: int = 0
    graph_bytes: int = 0  # growth of torch.cuda.memory_reserved() over all captures
    cache_bytes: int = 0
    checks: int = 0  # host looks at the device (one sync each)
    prefill_capture_s: dict[str, float] = field(default_factory=dict)
    prefill_replays: dict[str, int] = field(default_factory=dict)
    eager_prefills: int = 0  # prompts prefilled eagerly (prefill.py says when)
    notices: dict[str, int] = field(default_factory=dict)  # each warning's cause: shown once
    fused_groups: int = 0  # q/k/v and gate/up groups computed as one product each
    unfused: list[str] = field(default_factory=list)  # groups left as they were, and why
    attention: str = ""  # the decode attention: grouped (no cache copy), or why the model's own


class Decoder:
    """Greedy or sampled decoding of a causal LM with captured decode steps; see the module doc.

    Args:
        model: a transformers causal LM in eval mode (``model.eval()``), on one device.
        max_batch: the largest batch ``generate`` will take.
        max_length: the longest prompt plus new tokens.
        batch_sizes: the batch rungs to capture (default: powers of two up to ``max_batch``,
            and ``max_batch``; under ``compile`` from 2 where ``max_batch`` is 2 or more, see
            :func:`default_batch_rungs`); a batch is padded up to the next rung.
        steps_per_graph: decode steps per graph launch (1, 4, 16, ...): fewer launches and no
            Python between the steps of one launch.
        compile: ``True`` (or a ``torch.compile`` mode such as
            ``"max-autotune-no-cudagraphs"``, or a mapping of Inductor options such as
            ``{"coordinate_descent_tuning": True}``) to graph over ``torch.compile``'d kernels.
            ``True`` and a mapping compile the step with Inductor's ``combo_kernels`` unless
            the mapping says ``{"combo_kernels": False}`` (``compiled.STEP_OPTIONS``).
        check_every: look at the device for finished sequences every this many tokens (one
            sync each); ``generate`` stops at the first check after every sequence ended.
        do_sample: also capture the sampling graphs now (else on the first sampled request).
        warmup: eager runs before each capture.
        until_eos: one launch decodes until every row has ended or the request's
            ``max_new_tokens`` (a loop on the device, ``cg.while_loop``: CUDA 12.4+ and
            cuda-bindings); greedy only.
        eager: modules or module classes run eagerly between each step's graphs (``cg.graph``'s
            ``eager``), e.g. an fp32 MoE block that reads its routing on the host
            (``eager=[MixtralSparseMoeBlock]``). Not with ``compile`` or ``until_eos``.
        cache_lengths: the cache-length rungs (default: powers of two from 256 below the
            cache's length, and the length itself): a launch attends only to the shortest
            prefix of the cache that holds its positions, so short requests in a long cache
            do not read all of it. One graph per (batch rung, length rung); ``until_eos``
            uses the full length only.
        prefill_lengths: the prompt-length rungs whose prefill is recorded, one graph per
            (batch rung, prompt-length rung) captured on first use (default: powers of two from
            16 to 256); a prompt is right-padded to the next rung. Longer or left-padded prompts
            prefill eagerly, as all do with ``[]`` (``decoding/prefill.py``).
        save_compile: under ``compile``, write the compiled steps next to Inductor's on-disk
            cache, so that a later process loads them instead of tracing the model again
            (``integrations/saved_compile.py`` says when a file is used; ``stats`` counts
            the loads and saves). ``False``: ``torch.compile`` only, a few seconds less at a
            cold start and a full trace in every process.
        fuse: compute each layer's q, k and v, and gate and up, as one product each
            (``decoding/fused_projections.py``): the model's parameters become views of
            one buffer per group, in place, so in-place weight updates are seen by the next
            token. ``stats.unfused`` lists the groups that did not match, and why. A product
            of one row (batch 1, half or bfloat16, on a GPU with Triton) runs the one-row
            Triton kernel (``decoding/matvec.py``), the MLP's SiLU(gate) * up inside its
            down product; other batches run ``F.linear``. A model fused with
            ``fuse_projections(model)`` beforehand keeps that fusion's products.
        grouped_attention: one token's attention over grouped key/value heads reads the cache
            as it is, instead of copying each key/value head over its query heads
            (``decoding/grouped_attention.py``: the model's attention becomes that
            function, registered with transformers; other calls go to its SDPA attention).
            For models whose attention is ``"sdpa"``; ``stats.attention`` says which ran.
        attention_kernel: with ``grouped_attention``, one token's attention over a cache of at
            most ``decode_attention.MAX_POSITIONS`` positions runs as one Triton kernel
            (``decoding/attention.py``) instead of SDPA's kernels, where the
            compiled step has one cache length (or without ``compile``); ``False``: SDPA
            always.
    """

    @checked_keywords("Decoder")
    def __init__(
        self,
        model: Any,
        *,
        max_batch: int,
        max_length: int,
        batch_sizes: Sequence[int] | None = None,
        steps_per_graph: int = 1,
        compile: bool | str | Mapping[str, Any] = False,
        check_every: int = 16,
        do_sample: bool = False,
        warmup: int = 2,
        until_eos: bool = False,
        eager: Sequence[Any] = (),
        cache_lengths: Sequence[int] | None = None,
        prefill_lengths: Sequence[int] | None = None,
        save_compile: bool = True,
        fuse: bool = True,
        grouped_attention: bool = True,
        attention_kernel: bool = True,
    ):
        start = time.perf_counter()
        check_model(model)
        check_bool("fuse", fuse, "it says whether q/k/v and gate/up become one product each")
        check_bool(
            "grouped_attention", grouped_attention,
            "it says whether one token's attention reads grouped key/value heads in place",
        )  # fmt: skip
        check_bool(
            "attention_kernel", attention_kernel,
            "it says whether one token's attention over a short cache runs as one kernel",
        )  # fmt: skip
        for name, value in (
            ("max_batch", max_batch),
            ("max_length", max_length),
            ("steps_per_graph", steps_per_graph),
            ("check_every", check_every),
        ):
            check_positive_int(name, value, "it sizes buffers or counts steps")
        self.model = model
        self.cache_arg = cache_keyword(model)
        self.device = next(model.parameters()).device
        self.compiles = check_compile(compile)
        check_bool(
            "save_compile", save_compile, "it says whether compiled steps are written to disk"
        )
        self.rungs = sorted(set(batch_sizes or default_batch_rungs(max_batch, self.compiles)))
        if self.rungs[0] < 1 or self.rungs[-1] != max_batch:
            raise ConfigError(
                explain(
                    f"batch_sizes must be positive and end at max_batch={max_batch}, got "
                    f"{list(batch_sizes or [])}",
                    "a batch is padded up to the next rung, so the largest rung bounds the batch",
                    f"pass batch_sizes=[1, 2, 4, ..., {max_batch}] or leave it out",
                )
            )
        self.max_length = max_length
        self.steps = steps_per_graph
        self.until_eos = until_eos
        check_until_eos(until_eos, do_sample, steps_per_graph)
        self.eager = tuple(eager)
        check_eager(self.eager, self.compiles, until_eos)
        self.check_every = max(1, check_every // steps_per_graph)  # in graph launches
        self.warmup = warmup
        self.lock = threading.RLock()  # one request at a time: the rungs share cache and pool
        self.stats = DecodeStats()
        # Before anything is compiled or captured: the parameters become views of one buffer
        # per group (the same objects), which a trace or a capture then reads.
        if fuse:
            fusion = fuse_projections(model, matvec=True)
            self.stats.fused_groups, self.stats.unfused = len(fusion.fused), fusion.refused
        # The cache has steps_per_graph - 1 spare positions: the last launch of a request may
        # run past its last token (those steps are thrown away).
        cache_len = max_length + steps_per_graph - 1
        self.lengths = [cache_len] if until_eos else length_rungs(cache_len, cache_lengths)
        # One compile for all rungs: batch and cache length are dynamic dimensions, unless
        # there is only one (batch, length) shape.
        dynamic = len(self.rungs) * len(self.lengths) > 1
        # The kernel's choice reads the cache's length where the step is traced: a compiled
        # step whose length varies would be split by a guard on it, so that one keeps SDPA. A
        # step whose batch alone varies (one length rung) reads a constant length.
        kernel = attention_kernel and not (self.compiles and len(self.lengths) > 1)
        self.stats.attention = choose_attention(model, grouped_attention, kernel)
        # Eager: one function for both (a left-padded batch's mask and position ids as rows).
        self.forward = self.forward_padded = functools.partial(step_logits, model, self.cache_arg)
        self.compiled: set[bool] = set()  # the forwards compiled so far: padded or not
        self.greedy_tail = None
        self.caches = RungCaches(model, self.rungs, cache_len, self.lengths)
        self.saved_compiles: list[SavedCompile] = []
        if self.compiles:
            # The compiled step cuts each rung out of the one cache (compiled.py) and writes
            # new keys into it: a write through a view made outside the step would be compiled
            # as a copy of the layer's whole cache, per layer and token, static shapes too.
            cut = self.caches.cuttable()
            dynamic_length = len(self.lengths) > 1
            if cut:
                self.caches.write_through()
            elif dynamic:
                mark_rung_dims(self.caches.tensors(), batch=0, length=2 if dynamic_length else None)
            caches = self.caches if cut else None
            (self.forward, plain), (self.forward_padded, padded) = (
                compiled_forward(
                    model,
                    self.cache_arg,
                    compile,
                    dynamic=dynamic,
                    padded=p,
                    caches=caches,
                    save=save_compile,
                    dynamic_length=dynamic_length,
                )
                for p in (False, True)
            )
            self.greedy_tail, tail = compiled_tail(
                model, greedy_tail, dynamic=len(self.rungs) > 1, save=save_compile
            )
            self.saved_compiles = [plain, padded, tail]
        self.stats.cache_bytes = self.caches.bytes
        self.history = torch.zeros(max_batch, cache_len + 1, dtype=torch.long, device=self.device)
        self.params = SamplingParams.make(model.config.vocab_size, self.device)
        self.eos = torch.full((MAX_EOS,), -1, dtype=torch.long, device=self.device)
        self.pad = torch.zeros((), dtype=torch.long, device=self.device)
        # Left-padded prompts: which cache positions each row attends to, and how many padding
        # tokens it has (its position ids run that much behind the cache position).
        # (One spare position, as in the cache: every length rung's mask is a prefix view.)
        self.attends = torch.zeros(
            max_batch, 1, 1, cache_len + 1, dtype=torch.bool, device=self.device
        )
        self.padding = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.pool = Pool()
        self.stats.notices = self.pool.notices.counts  # kept up to date by the graphs
        self.graphs: dict[tuple[int, int, str], Any] = {}
        self.prefills = Prefills(self, prefill_lengths_of(cache_len, prefill_lengths))
        self.prepare("sample" if do_sample else "greedy")
        self.stats.setup_s = time.perf_counter() - start

    def prepare(self, mode: str) -> None:
        """Capture every rung's graph for ``mode`` now: ``"greedy"`` or ``"sample"``, with
        ``"+padded"`` for requests of left-padded prompts (captured on the first such request)."""
        # Decoding is inference: captured (and replayed, in generate) without autograd.
        with self.lock, torch.no_grad():
            missing = [
                (n, length)
                for n in self.rungs
                for length in self.lengths
                if (n, length, mode) not in self.graphs
            ]
            if not missing:
                return
            cuda = self.device.type == "cuda"
            if cuda:  # cached free blocks (from loading the model) would be counted as freed
                torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device) if cuda else 0
            # Warm-up draws random numbers; the caller's seeded stream must not see them.
            with torch.random.fork_rng(devices=[self.device] if cuda else []):
                if self.compiles and (padded := mode.endswith("+padded")) not in self.compiled:
                    start = time.perf_counter()
                    compile_forward(self, mode)
                    self.compiled.add(padded)
                    self.stats.compile_s += time.perf_counter() - start
                for n, length in reversed(missing):  # the largest first: the pool grows once
                    start = time.perf_counter()
                    self.graphs[n, length, mode] = capture_steps(self, n, length, mode)
                    self.stats.capture_s[self._key(mode, n, length)] = time.perf_counter() - start
            saved = self.saved_compiles
            self.stats.compiles_loaded = sum(step.loaded for step in saved)
            self.stats.compiles_saved = sum(step.saved for step in saved)
            self.stats.compile_save_s = sum(step.save_s for step in saved)
            self.stats.compile_not_saved = "; ".join(s.not_saved for s in saved if s.not_saved)
            if cuda:
                torch.cuda.empty_cache()  # warm-up activations: not the graphs' memory
                self.stats.graph_bytes += torch.cuda.memory_reserved(self.device) - before

    def _length_rung(self, end: int) -> int:
        """The index of the shortest cache-length rung holding positions ``[0, end)``."""
        return next(i for i, rung in enumerate(self.lengths) if rung >= end)

    def _key(self, mode: str, n: int, length: int) -> str:
        """The name of a graph in the statistics: ``"greedy batch 4"``, ``"... length 512"``."""
        full = length == self.caches.max_length
        return f"{mode} batch {n}" + ("" if full else f" length {length}")

    def chooser(self, mode: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The token choice of ``mode`` (greedy, or sampled with the current parameters)."""
        if mode.startswith("greedy"):
            return greedy
        params = self.params
        return lambda logits: sample(logits, params)

    @checked_keywords("Decoder.generate")
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = -1,
        pad_token_id: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prompt plus new tokens, ``[batch, length]``, as ``model.generate`` returns them.

        ``eos_token_id`` defaults to the model's generation config (``None``: never stop
        early); finished rows are filled with ``pad_token_id`` (default: the config's, else
        the first end-of-sequence id), and decoding stops once every row has finished.
        Greedy output equals ``model.generate(input_ids, max_new_tokens=..., do_sample=False)``.
        """
        batch, length, padding = check_request(
            input_ids,
            max_new_tokens,
            attention_mask,
            device=self.device,
            max_batch=self.rungs[-1],
            max_length=self.max_length,
        )
        eos, pad = stop_ids(self.model, eos_token_id, pad_token_id)
        check_until_eos(self.until_eos, do_sample, self.steps)
        mode = "sample" if do_sample else "greedy"
        if padding is not None:
            check_attention(self.model)
            mode += "+padded"
        with self.lock, torch.no_grad():
            if do_sample:
                self.params.set(temperature, top_k, top_p)
            self.prepare(mode)
            n = next(r for r in self.rungs if r >= batch)
            graphs = [self.graphs[n, rung, mode] for rung in self.lengths]
            # A weight moved to new memory: capture again now, before the prefill, from an
            # empty cache at position 0. A recapture's warm-up runs steps that advance the
            # position and the cache's counters; from the last request's end they would write
            # past the cache.
            for graphed in graphs:

                def start_over(inputs: tuple[torch.Tensor, ...] = graphed.inputs) -> None:
                    rewind(*inputs)
                    self.caches[n].reset()

                graphed.refresh(prepare=start_over)
            # Launch k decodes positions length + (k - 1) * steps onwards and attends to every
            # position before length + k * steps: the shortest length rung that holds them.
            at = self._length_rung(length + self.steps)
            token, position, finished, left = graphs[at].inputs
            run_prefill(self, input_ids, padding, n, mode, eos, pad, token, position, finished)
            left.fill_(max_new_tokens - 1)  # until_eos: one launch decodes them all
            launches = 1 if self.until_eos else math.ceil((max_new_tokens - 1) / self.steps)
            first, launched = at, [0] * len(self.lengths)  # launches per length rung
            for launch in range(1, launches + 1):
                if (end := length + launch * self.steps) > self.lengths[at]:
                    rung = self._length_rung(end)
                    state = graphs[rung].inputs  # the request moves on; the cache stays put
                    for mine, theirs in zip(state, (token, position, finished, left)):
                        mine.copy_(theirs)
                    at, (token, position, finished, left) = rung, state
                graphs[at](token, position, finished, left)
                launched[at] += 1
                if eos and launch % self.check_every == 0 and launch < launches:
                    self.stats.checks += 1
                    if bool(finished.all()):
                        break
            for i, count in enumerate(launched):
                if count or i == first:
                    key = self._key(mode, n, self.lengths[i])
                    self.stats.replays[key] = self.stats.replays.get(key, 0) + count
            # A guarded tensor that moved (a reloaded model) makes a graph capture again.
            self.stats.recaptures = sum(g.stats.recaptures for g in self.graphs.values())
            out = self.history[:batch, : length + max_new_tokens].clone()
        return trim_finished(out, length, eos) if eos else out

    def __repr__(self) -> str:
        return (
            f"<cudagraphs Decoder {type(self.model).__name__} rungs={self.rungs} "
            f"lengths={self.lengths} "
            f"steps_per_graph={self.steps} graphs={len(self.graphs)}>"
        )
