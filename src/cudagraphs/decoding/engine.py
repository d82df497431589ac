"""Continuous batching on graphs: requests join and leave a running batch between steps.

:class:`Engine` holds one cache of ``max_batch`` rows (slots), each row at a length of its own
(``slot_cache.py``), and one captured decode step per (batch rung, cache-length rung, mode)
(``slot_steps.py``). Requests are submitted at any time, from any thread or coroutine, and
each gets a :class:`~.completions.Completion` that streams its tokens. One worker thread runs
the loop; at every step boundary:

1. cancelled requests leave; requests waiting in the queue take the free slots (in order);
2. prompts go in, in chunks of at most ``prefill_chunk`` tokens per boundary over all
   joining requests, up to ``prefill_rows`` requests' chunks in one forward (each at most
   ``prefill_chunk // prefill_rows`` tokens), so a long prompt holds the running rows back
   one chunk at a time, not for its whole length; a request whose prompt is in emits its
   first token;
3. one decode step (``read_every`` steps back to back) runs for the slots in use, on the smallest batch rung that holds them and
   the shortest cache-length rung that holds the longest row; each live row emits a token;
4. rows that ended leave, and the last slot in use moves into the hole, so the slots in use
   stay at the front and the batch moves down the rung ladder as it empties.

Failures stay where they happen: a bad request is refused at :meth:`Engine.submit`; a full
queue refuses at once (:class:`~cudagraphs.Overloaded`); a prompt chunk that raises fails its
request; a decode step that raises fails the requests in that step
(:class:`~cudagraphs.StepFailedError`) and the engine goes on with the queue.

Right::

    engine = Engine(model, max_batch=16, max_length=1024)
    completion = engine.submit(prompt_ids, max_new_tokens=128)        # from any thread
    for token in completion: ...                                      # or: async for
    engine.close()

Wrong: one ``Decoder.generate`` per request from many threads: the calls take turns on the
decoder's lock, each a batch of one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import Pool
from ..errors import BatcherClosed, ConfigError, Overloaded, StepFailedError, explain
from ..options import check_bool, check_positive_int, checked_keywords
from ..workers import hold, start_worker
from .completions import Completion, cancelled
from .engine_metrics import EngineMetrics, EngineRecorder, engine_prometheus
from .fused_projections import fuse_projections
from .grouped_attention import choose_attention, takes_sdpa_mask
from .kv_cache import cache_keyword, checked_rungs, default_batch_rungs, length_rungs
from .prompts import EngineRequest, check_engine_request
from .requests import check_compile, check_model
from .row_sampling import choose
from .slot_cache import SlotCache
from .slot_prefill import SlotPrefill
from .slot_steps import SlotState, capture_slot_step, compiled_slot_logits

__all__ = ["Engine", "EngineStats"]

MODES = ("greedy", "mixed")


@dataclass
class EngineStats:
    """What the engine's graphs have done."""

    setup_s: float = 0.0
    graphs: int = 0  # decode steps captured (or, without CUDA, eager pass-throughs)
    replays: dict[str, int] = field(default_factory=dict)  # steps per graph
    recaptures: int = 0  # steps captured again (a parameter given new memory, say)
    prefill_chunks: int = 0
    eager_prefill_chunks: int = 0  # of those, run eagerly (slot_prefill.py says when)
    moves: int = 0  # rows moved into the hole a finished request left
    graph_bytes: int = 0  # growth of torch.cuda.memory_reserved() over the captures
    cache_bytes: int = 0
    attention: str = ""  # the decode attention: grouped (no cache copy), or why the model's own
    fused_groups: int = 0  # q/k/v and gate/up groups computed as one product each
    unfused: list[str] = field(default_factory=list)  # groups left as they were, and why
    compiled: bool = False  # steps and chunks run torch.compile'd kernels (Engine(compile=...))


@dataclass
class _Row:
    """A request in a slot: its host-side view (the device holds the rest)."""

    request: EngineRequest
    completion: Completion
    length: int = 0  # cache positions written: the prompt so far, then one per token fed
    decoding: bool = False  # prompt done, first token emitted, not ended


class Engine:
    """Continuous batching of a transformers causal LM over captured decode steps; see the
    module doc. Use it as ``with Engine(...) as engine:`` or close it when done; an engine no
    one holds any more is collected once it is idle (no request queued or running), its
    worker ended and its cache and graphs freed.

    Args:
        model: a transformers causal LM in eval mode, SDPA attention, on one device.
        max_batch: slots: requests decoding at once (the largest batch rung).
        max_length: cache positions per slot: the longest prompt plus new tokens.
        batch_sizes: the batch rungs (default: powers of two up to ``max_batch``, and it; from 2
            under ``compile``).
        cache_lengths: the cache-length rungs a step attends to (default as ``Decoder``'s).
        max_queue: requests that may wait for a slot; one more is refused at once
            (:class:`~cudagraphs.Overloaded`).
        prefill_chunk: prompt tokens put in per step boundary, over all joining requests.
        prefill_rows: joining requests whose chunks go in as rows of one forward (each
            forward costs a fixed few milliseconds of device time, whatever its tokens); a
            request's chunk holds at most ``prefill_chunk // prefill_rows`` tokens (16 at
            least).
        warmup: eager steps before each capture.
        do_sample: also capture the steps of batches with sampled rows now (else on the first
            such request).
        grouped_attention: one token's attention over grouped key/value heads reads the cache
            as it is, instead of a copy of every key/value head per query head (as the
            ``Decoder``'s, ``decoding/grouped_attention.py``), each row through its own mask;
            ``stats.attention`` says which ran.
        attention_kernel: with ``grouped_attention``, a short cache's one-token attention runs
            as one Triton kernel (``decoding/attention.py``) on a GPU; ``False``: SDPA.
        fuse: compute each layer's q, k and v, and gate and up, as one product each, in the
            steps and the prompt chunks alike, as the ``Decoder``'s ``fuse`` does
            (``decoding/fused_projections.py``): the parameters become views of one buffer
            per group, the same objects, so an in-place weight update is read by the next
            step. ``stats.unfused`` lists the groups that did not match, and why.
        compile: ``True`` (or a ``torch.compile`` mode, or a mapping of Inductor options, as
            the ``Decoder``'s ``compile``) to record each decode step and each batch of prompt
            chunks over ``torch.compile``'d kernels: fewer, fused kernels per forward. One
            compile for the steps of every batch rung and cache-length rung, one for the
            chunks of every row, chunk and cache-length rung; the batch and row rungs then
            start at 2 (Dynamo traces a size of 1 apart). A chunk that runs eagerly (longer
            than the longest rung) runs the model's own kernels.
        read_every: decode steps launched back to back before the host reads their tokens
            (one sync per read). More: fewer syncs and less host work per token, but tokens
            arrive in bursts, and joins and leaves wait for the read.
        name: the engine's name in its metrics.
    """

    @checked_keywords("Engine")
    def __init__(
        self,
        model: Any,
        *,
        max_batch: int,
        max_length: int,
        batch_sizes: Sequence[int] | None = None,
        cache_lengths: Sequence[int] | None = None,
        max_queue: int = 1024,
        prefill_chunk: int = 1024,
        prefill_rows: int = 4,
        warmup: int = 2,
        do_sample: bool = False,
        grouped_attention: bool = True,
        attention_kernel: bool = True,
        fuse: bool = True,
        read_every: int = 1,
        compile: bool | str | Mapping[str, Any] = False,
        name: str = "engine",
    ):
        start = time.perf_counter()
        check_model(model)
        if not takes_sdpa_mask(model):
            raise ConfigError(
                explain(
                    f"Engine needs the model's SDPA attention, it uses "
                    f"{getattr(model.config, '_attn_implementation', None)!r}",
                    "rows at different lengths share one step, each given the positions it "
                    "attends to as a prepared boolean mask, as SDPA reads it",
                    "load the model with attn_implementation='sdpa', or call "
                    "model.set_attn_implementation('sdpa')",
                )
            )
        for key, value in (
            ("max_batch", max_batch),
            ("max_length", max_length),
            ("max_queue", max_queue),
            ("prefill_chunk", prefill_chunk),
            ("prefill_rows", prefill_rows),
            ("warmup", warmup),
            ("read_every", read_every),
        ):
            check_positive_int(key, value, "it sizes the cache, the queue or the steps")
        self.model, self.name = model, name
        self.max_batch, self.max_length = max_batch, max_length
        self.max_queue, self.prefill_chunk, self.warmup = max_queue, prefill_chunk, warmup
        self.prefill_rows = min(prefill_rows, max_batch)
        self.row_chunk = max(16, prefill_chunk // self.prefill_rows)  # one request's chunk
        self.read_every = read_every
        self.cache_arg = cache_keyword(model)
        self.device = next(model.parameters()).device
        self.compiles = check_compile(compile)
        self.rungs = checked_rungs(
            "batch_sizes", batch_sizes or default_batch_rungs(max_batch, self.compiles),
            max_batch, "a step of n slots runs on the smallest rung that holds them",
            f"pass e.g. batch_sizes=[1, 4, {max_batch}], or leave it out",
        )  # fmt: skip
        if self.rungs[-1] != max_batch:
            self.rungs.append(max_batch)
        self.lengths = length_rungs(max_length, cache_lengths)
        for key, value in (("grouped_attention", grouped_attention), ("attention_kernel", attention_kernel)):  # fmt: skip
            check_bool(key, value, "it says how one token's attention reads the cache")
        check_bool("fuse", fuse, "it says whether q/k/v and gate/up become one product each")
        self.cache = SlotCache(model, max_batch, max_length, chunk_rows=self.prefill_rows)
        self.state = SlotState.make(self.cache, model.config.vocab_size)
        # Once the model is known to fit the cache, and before a compile or a capture reads
        # the parameters, which fusing makes views of one buffer per group.
        fusion = fuse_projections(model, matvec=True) if fuse else None
        # Each step's tokens, for a read after read_every steps.
        self._emitted = self.state.emitted.new_zeros(read_every, *self.state.emitted.shape)
        self._stats = EngineStats(cache_bytes=self.cache.bytes)
        if fusion is not None:
            self._stats.fused_groups, self._stats.unfused = len(fusion.fused), fusion.refused
        self._stats.attention = choose_attention(model, grouped_attention, attention_kernel)
        self._stats.compiled = self.compiles
        # The decode steps' logits, compiled (after the attention is chosen: the trace reads it).
        self._forward = compiled_slot_logits(
            model, self.cache_arg, self.cache, compile, dynamic_length=len(self.lengths) > 1
        ) if self.compiles else None  # fmt: skip
        self.pool = Pool()
        self.graphs: dict[tuple[int, int, str], Any] = {}
        self.prefills = SlotPrefill(
            model, self.cache_arg, self.cache, self.lengths, budget=self.row_chunk,
            pool=self.pool, warmup=warmup, compile=compile,
        )  # fmt: skip
        self.recorder = EngineRecorder(max_batch)
        self.rows: list[_Row] = []  # slot k holds rows[k]: the slots in use are the first
        self._queue: deque[tuple[EngineRequest, Completion]] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._drain = True
        self._next_id = 0
        # The worker captures the steps before it serves (a graph is replayed by the thread
        # that captured it); a failure there is raised here.
        self._modes = MODES[: 2 if do_sample else 1]
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._started = False
        # The worker holds the engine only while it has work (workers.py): an engine no one
        # holds is collected once idle.
        self._worker = start_worker(
            self, self._wake, f"cudagraphs-{name}", Engine._idle, Engine._work,
            context=Engine._worker_modes,
        )  # fmt: skip
        self._ready.wait()
        if self._setup_error is not None:
            raise self._setup_error
        self._stats.setup_s = time.perf_counter() - start

    # -- the public surface --------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """What the engine's graphs have done (:class:`EngineStats`)."""
        self._stats.recaptures = sum(g.stats.recaptures for g in list(self.graphs.values()))
        self._stats.eager_prefill_chunks = self.prefills.eager
        return self._stats

    @property
    def graphed(self) -> bool:
        """Whether the steps replay captured graphs (``False``: eager, no CUDA here)."""
        return self.device.type == "cuda" and torch.cuda.is_available()

    @checked_keywords("Engine.submit")
    def submit(
        self,
        prompt: Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = -1,
    ) -> Completion:
        """Queue one request and return its :class:`~.completions.Completion` at once.

        Greedy unless ``do_sample`` (then ``temperature``, ``top_k``, ``top_p`` as
        ``generate``'s, and ``seed``: the same seed gives the same tokens whatever else is in
        the batch). ``eos_token_id``: the model's generation config's by default, ``None`` to
        decode ``max_new_tokens`` always. Raises :class:`~cudagraphs.BadRequestError` for a
        request that cannot be served, :class:`~cudagraphs.Overloaded` when ``max_queue``
        requests wait already, :class:`~cudagraphs.BatcherClosed` after :meth:`close`."""
        request = check_engine_request(
            prompt, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id, model=self.model,
            max_length=self.max_length,
        )  # fmt: skip
        with self._wake:
            if self._closing:
                self.recorder.error("BatcherClosed")
                raise BatcherClosed(f"engine {self.name!r} is closed: it takes no new requests")
            if len(self._queue) >= self.max_queue:
                self.recorder.error("Overloaded")
                raise Overloaded(
                    explain(
                        f"engine {self.name!r} has {len(self._queue)} requests waiting, its "
                        f"max_queue",
                        "a bounded queue refuses at once instead of letting waits grow without "
                        "bound; nothing of this request was queued",
                        "retry after a moment, or build the engine with a larger max_queue",
                    ),
                    retry_after_s=1.0,
                )
            completion = Completion(self._next_id, request.prompt, request.max_new_tokens)
            self._next_id += 1
            self._queue.append((request, completion))
            hold(self)  # until its worker finds it idle: nothing queued is lost
            self.recorder.submitted(completion.submitted)
            self._wake.notify()
        return completion

    def generate(self, prompt: Sequence[int] | torch.Tensor, **settings: Any) -> list[int]:
        """:meth:`submit` and wait: the new tokens (``settings`` as :meth:`submit`'s)."""
        return self.submit(prompt, **settings).result()

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's counters (``engine_metrics.py``)."""
        with self._wake:
            waiting, running = len(self._queue), len(self.rows)
        return self.recorder.snapshot(waiting, running)

    def prometheus(self) -> str:
        """:meth:`metrics` as Prometheus text."""
        return engine_prometheus(self.metrics(), self.name)

    def health(self) -> dict[str, Any]:
        """What a health check reports: running or not, graphs or eager, and where."""
        alive = self._worker is not None and self._worker.is_alive()
        return {
            "status": "ok" if alive and not self._closing else "closing" if alive else "stopped",
            "graphs": self.graphed,
            "why_eager": None if self.graphed else "no CUDA device: the steps run eagerly",
            "device": str(self.device),
            "captured_steps": sum(1 for g in self.graphs.values() if _captured(g)),
            "compiled": self.compiles,  # the steps' and chunks' kernels from torch.compile
            "slots": self.max_batch,
            "max_length": self.max_length,
        }

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; with ``drain`` finish the queued and running ones first,
        else fail them (:class:`~cudagraphs.BatcherClosed`). Returns once the worker stopped
        (or after ``timeout`` seconds)."""
        with self._wake:
            self._closing, self._drain = True, drain
            self._wake.notify()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _prepare(self) -> None:
        """Capture every rung's step of each mode (``"greedy"``, ``"mixed"``) and every prompt
        chunk's rung before the worker serves: no slot holds a live row, so the steps change
        nothing read later, and no request waits for a capture."""
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        for mode in self._modes:
            for n in reversed(self.rungs):  # the largest first: the pool grows once
                for length in self.lengths:
                    step = self._step(n, length, mode)
                    for _ in range(self.warmup + 1):  # the eager calls, then the capture
                        step()
        self.prefills.prepare()
        if cuda:
            self._stats.graph_bytes += torch.cuda.memory_reserved(self.device) - before

    def __repr__(self) -> str:
        return (
            f"<cudagraphs Engine {type(self.model).__name__} slots={self.max_batch} "
            f"rungs={self.rungs} lengths={self.lengths} running={len(self.rows)}>"
        )

    # -- the worker ----------------------------------------------------------------------------

    def _start(self) -> bool:
        """Capture the steps (on the worker: a graph is replayed by the thread that captured
        it); False, with the error kept for the constructor, where that failed."""
        try:
            self._prepare()
            return True
        except BaseException as error:
            self._setup_error = error
            return False
        finally:
            self._ready.set()

    def _worker_modes(self) -> contextlib.ExitStack:
        """What the worker runs under: no autograd, and the engine's device current (the
        steps take no tensor argument: they are captured on the current device)."""
        modes = contextlib.ExitStack()
        modes.enter_context(torch.no_grad())
        if self.device.type == "cuda":
            modes.enter_context(torch.cuda.device(self.device))
        return modes

    def _work(self) -> bool:
        """The worker's next piece of work: the captures first, then one step boundary.
        False: stop."""
        if not self._started:
            self._started = True
            return self._start()
        if not self._next_boundary():
            return False
        self._leave_cancelled()
        self._prefill()
        if any(row.decoding for row in self.rows):
            self._decode()
        return True

    def _idle(self) -> bool:
        """Started, and nothing queued, running or closing (under the condition): the worker
        may wait."""
        return self._started and not self._queue and not self.rows and not self._closing

    def _next_boundary(self) -> bool:
        """Admit queued requests into free slots (the worker saw work). False: stop."""
        with self._wake:
            if self._closing and not self._drain:
                self._fail_all(BatcherClosed(f"engine {self.name!r} was closed without draining"))
                return False
            if self._closing and not self._queue and not self.rows:
                return False
            joining = []
            while self._queue and len(self.rows) + len(joining) < self.max_batch:
                joining.append(self._queue.popleft())
        for request, completion in joining:
            if completion.cancel_requested:
                self._end(completion, "cancelled", cancelled(completion.id))
                continue
            self._join(request, completion)
        return True

    def _join(self, request: EngineRequest, completion: Completion) -> None:
        slot, state = len(self.rows), self.state
        self.rows.append(_Row(request, completion))
        state.lengths[slot] = 0
        state.active[slot] = False
        state.finished[slot] = False
        state.left[slot] = request.max_new_tokens - 1  # the first comes from the prompt
        state.eos[slot] = -1
        if request.eos:
            state.eos[slot, : len(request.eos)] = torch.tensor(request.eos)
        state.settings.set(
            slot, temperature=request.temperature, top_k=request.top_k,
            top_p=request.top_p, seed=request.seed,
        )  # fmt: skip

    def _leave_cancelled(self) -> None:
        for row in [row for row in self.rows if row.completion.cancel_requested]:
            self._leave(row, "cancelled", cancelled(row.completion.id))

    def _prefill(self) -> None:
        """Put prompt chunks in, at most ``prefill_chunk`` tokens over all joining rows, up to
        ``prefill_rows`` rows' chunks per forward."""
        budget, batch = self.prefill_chunk, []
        for row in [row for row in self.rows if not row.decoding]:
            if budget == 0:
                break
            take = min(budget, self.row_chunk, len(row.request.prompt) - row.length)
            budget -= take
            batch.append((row, take))
            if len(batch) == self.prefill_rows:
                self._prefill_batch(batch)
                batch = []
        if batch:
            self._prefill_batch(batch)

    def _prefill_batch(self, batch: list[tuple[_Row, int]]) -> None:
        """One forward of these rows' chunks; each row whose prompt is then in emits its
        first token (one read for all of them)."""
        slots = [self.rows.index(row) for row, _ in batch]
        chunks = [
            (slot, row.length, row.request.prompt[row.length : row.length + take])
            for slot, (row, take) in zip(slots, batch)
        ]
        try:
            logits = self.prefills.logits(chunks)
        except Exception as error:  # these requests alone: the running rows are untouched
            for row, _ in batch:
                failure = StepFailedError(
                    f"the prompt of request {row.completion.id} failed to prefill: {error}"
                )
                failure.__cause__ = error
                self._leave(row, "error", failure)
            return
        done = []
        live = torch.ones(1, dtype=torch.bool, device=self.device)
        for k, (slot, (row, take)) in enumerate(zip(slots, batch)):
            row.length += take
            self.state.lengths[slot] = row.length
            self._stats.prefill_chunks += 1
            if row.length == len(row.request.prompt):
                chosen = choose(logits[k : k + 1], self.state.settings, slice(slot, slot + 1), live)
                done.append((slot, row, chosen))
        if not done:
            return
        tokens = torch.cat([chosen for _, _, chosen in done])[:, 0].tolist()
        for (slot, row, _), token in zip(done, tokens):
            # Every row first: a row that ends at once leaves, and a move fills its slot.
            self.state.tokens[slot] = token
            self.state.active[slot] = True
            row.decoding = True
        for (_, row, _), token in zip(done, tokens):
            ended = token in row.request.eos or row.request.max_new_tokens == 1
            self._emit(row, [token], ended=ended)

    def _decode(self) -> None:
        """``read_every`` steps of the slots in use, then one read of their tokens."""
        count, steps = len(self.rows), self.read_every
        n = next(r for r in self.rungs if r >= count)
        decoding = [row for row in self.rows if row.decoding]
        # The positions the last of these steps attends to (a row never passes max_length:
        # once it has emitted its last token it is no longer live and does not advance).
        longest = min(max(row.length for row in decoding) + steps, self.max_length)
        length = next(size for size in self.lengths if size >= longest)
        mode = MODES[any(row.request.temperature > 0 for row in decoding)]
        try:
            step = self._step(n, length, mode)
            for k in range(steps):
                step()  # a stale graph captures again, then replays
                if steps > 1:
                    self._emitted[k, :count].copy_(self.state.emitted[:count])
            read = self._emitted[:steps, :count] if steps > 1 else self.state.emitted[None, :count]
            emitted = read.tolist()
        except Exception as error:  # the rows of this step fail; the engine goes on
            failure = StepFailedError(
                explain(
                    f"the decode step of {len(decoding)} requests (batch rung {n}, cache "
                    f"length {length}) raised {type(error).__name__}: {error}",
                    "the requests in a failed step may hold a partly written cache row",
                    "the engine serves the other requests; resubmit these, and see the cause",
                )
            )
            failure.__cause__ = error
            for row in decoding:
                self._leave(row, "error", failure)
            return
        key = f"{mode} batch {n} length {length}"
        self._stats.replays[key] = self._stats.replays.get(key, 0) + steps
        for _ in range(steps):
            self.recorder.step(len(decoding), n)
        # By slot at the steps: a row that leaves moves another into its slot.
        stepped = []
        for k, row in enumerate(self.rows):
            if not row.decoding:
                continue
            tokens, ended = [], False
            for at in emitted:  # up to and with the step at which the row ended
                tokens.append(at[k][0])
                if at[k][1]:
                    ended = True
                    break
            stepped.append((row, tokens, ended))
        for row, tokens, _ in stepped:  # before any row leaves: a move copies its whole length
            row.length += len(tokens)
        for row, tokens, ended in stepped:
            self._emit(row, tokens, ended)

    def _step(self, n: int, length: int, mode: str) -> Any:
        """The step of rung (``n``, ``length``) in ``mode``, made on first use. Its first
        calls run eagerly and the next captures (``capture_slot_step``): each is one real
        step, so a step first needed while rows decode serves them from its first call."""
        key = (n, length, mode)
        if key not in self.graphs:
            self.graphs[key] = capture_slot_step(
                self.model, self.cache_arg, self.cache, self.state, n, length, mode,
                pool=self.pool, warmup=self.warmup, forward=self._forward,
            )  # fmt: skip
            self._stats.graphs = len(self.graphs)
        return self.graphs[key]

    def _emit(self, row: _Row, tokens: list[int], ended: bool) -> None:
        completion = row.completion
        completion.add(tokens)
        self.recorder.tokens(completion.submitted, completion.token_times, len(tokens))
        if ended:
            reason = "stop" if tokens[-1] in row.request.eos else "length"
            self._leave(row, reason, None)

    def _leave(self, row: _Row, reason: Any, error: BaseException | None) -> None:
        """End ``row``'s request and free its slot: the last slot in use moves into it."""
        slot, last = self.rows.index(row), len(self.rows) - 1
        self._end(row.completion, reason, error)
        row.decoding = False
        if slot != last:
            moving = self.rows[last]
            self.cache.move(last, slot, moving.length)
            self.state.move(last, slot)
            self.rows[slot] = moving
            self._stats.moves += 1
        self.rows.pop()
        self.state.active[last] = False

    def _end(self, completion: Completion, reason: Any, error: BaseException | None) -> None:
        completion.end(reason, error)
        self.recorder.ended(reason)
        if error is not None:
            self.recorder.error(type(error).__name__)

    def _fail_all(self, error: BaseException) -> None:
        while self._queue:
            _, completion = self._queue.popleft()
            self._end(completion, "error", error)
        for row in list(self.rows):
            self._leave(row, "error", error)


def _captured(graphed: Any) -> bool:
    return getattr(getattr(graphed, "stats", None), "state", None) == "captured"
