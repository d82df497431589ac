"""``cg.Batcher``: micro-batching of concurrent requests into one call of a (bucketed) graph.

Callers submit requests of any number of rows up to the largest batch; one worker thread takes
them in arrival order until the batch is full or the oldest has waited ``max_wait_ms``,
concatenates them, calls the function once (a bucketed graph pads the batch into its rung and
replays) and hands each caller a copy of its own rows. Everything that can go wrong with one
request fails that request alone, before it is queued: wrong structure, shape, dtype, device,
too many rows. A full queue refuses at once (:class:`Overloaded`); a request that waits past its
deadline is failed, not run (:class:`DeadlineExceeded`); a cancelled one is dropped; ``close``
stops intake and drains (or fails) the queue, and every request is answered exactly once. A
batcher no one holds is collected once its queue is empty, and its worker ends.

Right::

    graph = cg.graph(model, x, buckets={"B": cg.powers_of_two(64)})
    batcher = cg.Batcher(graph, x[:1])            # one request: any rows, x's trailing shape
    y = await batcher(x_request)                  # asyncio
    y = batcher.run(x_request, timeout=1.0)       # from a thread
    batcher.close()

Wrong: calling one graph from many request handlers directly: calls serialize on its lock and
each replays a batch of one, and outputs must be cloned under the lock.

The worker runs ``fn`` under the grad and inference modes of the thread that built the
batcher (the modes its graph was most likely captured under): grad mode is per thread, so a
caller's ``no_grad`` or ``inference_mode`` would not reach it. The answers are ordinary
tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..core import NAMESPACE
from ..errors import BatcherClosed, ConfigError, DeadlineExceeded, Overloaded, explain
from ..options import check_positive_int, refuse_unknown_keywords
from ..workers import hold, start_worker
from .metrics import BatcherMetrics, MetricsRecorder, prometheus
from .requests import RequestSpec, concatenate, split, to_device

__all__ = ["Batcher"]


@dataclass
class _Request:
    leaves: list[Any]
    rows: int
    future: concurrent.futures.Future[Any]
    submitted: float
    deadline: float | None  # perf_counter time after which it is failed instead of run


class Batcher:
    """Micro-batches concurrent requests into single calls of ``fn``; see the module doc.

    Args:
        fn: called with one batch (the requests concatenated along dimension 0); every tensor
            it returns must have the batch as its first dimension. Typically a bucketed
            ``cg.graph``, whose ladder then gives ``max_batch`` and the padding figures.
        *example_args: one example request, as ``fn``'s positional arguments.
        max_batch: the most rows per call (default: the bucketed graph's largest rung).
        max_wait_ms: how long the oldest request waits for others before its batch runs.
        max_queue: requests waiting at most; beyond it, :class:`Overloaded` at once.
        deadline_s: default per-request deadline (``None``: none).
        name: the ``batcher`` label in the metrics.
        request_device: where request tensors arrive and answers are returned (``None``: the
            example's device). A server that parses requests on the host passes ``"cpu"``:
            the worker then moves each batch to the GPU and its output back once, so no
            request handler waits on the GPU.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *example_args: Any,
        max_batch: int | None = None,
        max_wait_ms: float = 2.0,
        max_queue: int = 1024,
        deadline_s: float | None = None,
        name: str | None = None,
        request_device: str | torch.device | None = None,
        **unknown: Any,
    ):
        refuse_unknown_keywords("cg.Batcher", unknown, Batcher.__init__)
        ladders = getattr(fn, "ladders", None)
        rungs = (
            sorted(next(iter(ladders.values())))
            if isinstance(ladders, dict) and len(ladders) == 1
            else None
        )
        if max_batch is None:
            if rungs is None:
                raise ConfigError(
                    explain(
                        "Batcher needs max_batch for a function without one batch ladder",
                        "it bounds how many rows one call may take",
                        "pass max_batch=N, or a graph built with buckets={'B': [...]}",
                    )
                )
            max_batch = rungs[-1]
        check_positive_int("max_batch", max_batch, "it bounds the rows of one call")
        check_positive_int("max_queue", max_queue, "it bounds the requests waiting")
        if not max_wait_ms >= 0:
            raise ConfigError(
                explain(
                    f"max_wait_ms must be >= 0, got {max_wait_ms!r}",
                    "it is how long a request waits for others to join its batch",
                    "pass max_wait_ms=2.0 (0: run whatever is queued at once)",
                )
            )
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.request_device = None if request_device is None else torch.device(request_device)
        self.spec = RequestSpec(example_args, max_batch, self.request_device)
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.max_queue = max_queue
        self.deadline_s = deadline_s
        self.recorder = MetricsRecorder(max_batch, rungs)
        self._queue: deque[_Request] = deque()
        self._ready = threading.Condition()
        # Grad and inference mode are per thread: the worker runs under the creator's, the
        # modes the graph was most likely captured under (a graph checks them on every call).
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self._closed = False
        # The worker holds the batcher only while it has work (workers.py): a batcher no one
        # holds is collected once idle, and with it the graph it serves.
        self._worker = start_worker(
            self, self._ready, f"cudagraphs-batcher-{self.name}", Batcher._idle, Batcher._work,
            context=Batcher._worker_modes,
        )  # fmt: skip

    # --- intake -------------------------------------------------------------------------

    def submit(self, *args: Any, deadline_s: float | None = None) -> concurrent.futures.Future[Any]:
        """Queue one request; a future of its own rows of the output. Raises at once for a
        request that cannot join a batch, a full queue or a closed batcher."""
        try:
            leaves, rows = self.spec.check(args)
        except Exception as error:
            self.recorder.error(type(error).__name__)
            raise
        now = time.perf_counter()
        deadline = deadline_s if deadline_s is not None else self.deadline_s
        request = _Request(
            leaves,
            rows,
            concurrent.futures.Future(),
            now,
            None if deadline is None else now + deadline,
        )
        with self._ready:
            if self._closed:
                self.recorder.error("BatcherClosed")
                raise BatcherClosed(
                    explain(
                        f"batcher {self.name!r} is closed",
                        "close() stops intake before the queue is drained",
                        "submit before closing, or build a new Batcher",
                    )
                )
            if len(self._queue) >= self.max_queue:
                self.recorder.error("Overloaded")
                raise Overloaded(
                    explain(
                        f"batcher {self.name!r} has {len(self._queue)} requests waiting "
                        f"(max_queue={self.max_queue})",
                        "an unbounded queue would answer every request ever later instead",
                        "retry after a short wait (HTTP 503), add capacity, or raise max_queue",
                    )
                )
            self._queue.append(request)
            hold(self)  # until its worker finds it idle: nothing queued is lost
            self._ready.notify()
        return request.future

    def run(self, *args: Any, timeout: float | None = None, deadline_s: float | None = None) -> Any:
        """Submit and wait (from a thread); ``timeout`` bounds the wait, ``deadline_s`` the
        queueing."""
        return self.submit(*args, deadline_s=deadline_s).result(timeout)

    async def __call__(self, *args: Any, deadline_s: float | None = None) -> Any:
        """Submit and await (asyncio). Cancelling the awaiting task removes a waiting request."""
        return await asyncio.wrap_future(self.submit(*args, deadline_s=deadline_s))

    # --- shutdown -----------------------------------------------------------------------

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; answer the queued ones (``drain``) or fail them with
        :class:`BatcherClosed`; wait for the worker to finish."""
        with self._ready:
            self._closed = True
            if not drain:
                while self._queue:
                    self._fail(self._queue.popleft(), BatcherClosed(
                        explain(
                            f"batcher {self.name!r} was closed without draining",
                            "close(drain=False) fails what is still queued",
                            "use close(drain=True) to answer queued requests first",
                        )
                    ))  # fmt: skip
            self._ready.notify_all()
        self._worker.join(timeout)

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    async def __aenter__(self) -> Batcher:
        return self

    async def __aexit__(self, *_: Any) -> None:
        await asyncio.to_thread(self.close)

    # --- metrics ------------------------------------------------------------------------

    def metrics(self) -> BatcherMetrics:
        """Counters now: queue depth, batch fill, padding, latency percentiles, errors..."""
        with self._ready:
            depth = len(self._queue)
        return self.recorder.snapshot(depth)

    def prometheus(self) -> str:
        """The same counters in Prometheus' text format (for a ``/metrics`` endpoint)."""
        return prometheus(self.metrics(), self.name)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<cudagraphs Batcher {self.name!r} max_batch={self.max_batch} {state} queued={len(self._queue)}>"

    # --- the worker ---------------------------------------------------------------------

    def _worker_modes(self) -> contextlib.ExitStack:
        """What the worker runs under: the creator's grad and inference modes (per thread),
        the modes the graph was most likely captured under."""
        grad, inference = self._modes
        modes = contextlib.ExitStack()
        modes.enter_context(torch.inference_mode(inference))
        modes.enter_context(torch.set_grad_enabled(grad and not inference))
        return modes

    def _idle(self) -> bool:
        """Nothing queued and not closed (under the condition): the worker may wait."""
        return not self._queue and not self._closed

    def _work(self) -> bool:
        """Gather and serve one batch. False: closed and empty, stop."""
        batch = self._gather()
        if batch is None:
            return False
        if batch:
            self._serve(batch)
        return True

    def _gather(self) -> list[_Request] | None:
        """The next batch, in arrival order: full, or the oldest request waited max_wait.
        ``None`` once closed and empty."""
        with self._ready:
            while not self._queue:
                if self._closed:
                    return None
                self._ready.wait()
            start = self._queue[0].submitted
            while not self._closed and self._rows_queued() < self.max_batch:
                left = start + self.max_wait_s - time.perf_counter()
                if left <= 0:
                    break
                self._ready.wait(left)
            batch: list[_Request] = []
            rows = 0
            now = time.perf_counter()
            while self._queue and rows + self._queue[0].rows <= self.max_batch:
                request = self._queue.popleft()
                if not request.future.set_running_or_notify_cancel():
                    self.recorder.error("Cancelled")  # cancelled while waiting: dropped
                    continue
                if request.deadline is not None and now > request.deadline:
                    self._fail(request, DeadlineExceeded(
                        explain(
                            f"the request waited {now - request.submitted:.3f} s in batcher "
                            f"{self.name!r}, past its deadline",
                            "the queue was longer than the deadline allows",
                            "raise deadline_s, add capacity, or shed load earlier",
                        )
                    ), running=True)  # fmt: skip
                    continue
                batch.append(request)
                rows += request.rows
            return batch

    def _rows_queued(self) -> int:
        return sum(r.rows for r in self._queue)

    def _serve(self, batch: list[_Request]) -> None:
        began = time.perf_counter()
        try:
            inputs = concatenate(self.spec, [r.leaves for r in batch])
            # Copy the rows out before any other caller of fn can replay over them. Grad mode is
            # per thread, so the callers' no_grad/inference_mode does not reach this worker:
            # a batcher serves inference, so it runs fn without autograd itself.
            with torch.no_grad(), getattr(self.fn, "lock", contextlib.nullcontext()):
                called = time.perf_counter()
                output = self.fn(*inputs)
                if self.request_device is not None:
                    # The move below waits for the GPU anyway; waiting here first keeps the
                    # GPU's time out of the batcher's own figure.
                    _wait_for(output)
                returned = time.perf_counter()
                if self.request_device is not None:
                    output = to_device(output, self.request_device)
                answers = split(output, [r.rows for r in batch])
        except Exception as error:
            for request in batch:
                self._fail(request, error, running=True)
            return
        self.recorder.batch(
            [r.rows for r in batch], (time.perf_counter() - began) - (returned - called)
        )
        for request, answer in zip(batch, answers):
            request.future.set_result(answer)
            self.recorder.answered(request.submitted)

    def _fail(self, request: _Request, error: BaseException, *, running: bool = False) -> None:
        self.recorder.error(type(error).__name__)
        if running or request.future.set_running_or_notify_cancel():
            request.future.set_exception(error)


def _wait_for(output: Any) -> None:
    """Wait until the current CUDA stream has produced ``output`` (nothing without CUDA)."""
    device = next(
        (
            x.device
            for x in optree.tree_leaves(output, namespace=NAMESPACE)
            if isinstance(x, torch.Tensor)
        ),
        None,
    )
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
