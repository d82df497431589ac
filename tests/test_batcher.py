"""cg.Batcher on the CPU (its function a pass-through graph or plain code): batching and
splitting, padding figures, one bad request among good ones, back-pressure, deadlines,
cancellation, shutdown with requests in flight, metrics; hypothesis for arrival orders and
sizes."""

from __future__ import annotations

import asyncio
import gc
import re
import threading
import time
import warnings
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cudagraphs as cg

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")

WEIGHT = torch.randn(16, 4)


def model(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ WEIGHT) + x[:, :4]


class Gate:
    """A function that blocks until released, recording each batch's rows: requests pile up
    behind it, so what the next batch holds is decided by the test."""

    def __init__(self, fn=model) -> None:
        self.fn, self.open, self.batches = fn, threading.Event(), []
        self.entered = threading.Event()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.open.wait(10)
        self.batches.append(x.shape[0])
        return self.fn(x)


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, 16)


def test_requests_are_batched_and_each_caller_gets_its_own_rows() -> None:
    gate = Gate()
    with cg.Batcher(gate, rows(1), max_batch=8, max_wait_ms=50) as batcher:
        first = batcher.submit(rows(1))
        assert gate.entered.wait(5)  # the worker is inside the first batch: the rest pile up
        requests = [rows(n) for n in (3, 2, 1, 2, 4)]
        futures = [batcher.submit(x) for x in requests]
        gate.open.set()
        answers = [f.result(5) for f in futures]
        first.result(5)
    for x, y in zip(requests, answers):
        torch.testing.assert_close(y, model(x))
        assert y._base is None  # owned, not a view of the batch's output
    assert gate.batches == [1, 8, 4]  # 3+2+1+2 = 8 rows, then the 4-row request
    metrics = batcher.metrics()
    assert metrics.requests == 6 and metrics.batches == 3 and metrics.rows == 13


def test_a_bucketed_graph_sets_max_batch_and_the_padding_figures() -> None:
    graph = cg.graph(model, rows(8), buckets={"B": [1, 2, 4, 8]})
    with cg.Batcher(graph, rows(1), max_wait_ms=0) as batcher:
        assert batcher.max_batch == 8
        for n in (3, 5, 8):  # rungs 4, 8, 8: 4 padded rows of 20
            torch.testing.assert_close(
                batcher.run(rows(n) * 0 + 1, timeout=5), model(torch.ones(n, 16))
            )
    metrics = batcher.metrics()
    assert metrics.padding_waste == pytest.approx(4 / 20)


def test_one_bad_request_fails_alone_with_the_reason() -> None:
    gate = Gate()
    with cg.Batcher(gate, rows(1), max_batch=4, max_wait_ms=20) as batcher:
        good = [batcher.submit(rows(1)) for _ in range(2)]
        bad = {
            "shape": (rows(2)[:, :8], r"args\[0\] has shape \(2, 8\), expected \(rows, 16\)"),
            "dtype": (rows(1).double(), r"is torch.float64 on cpu, expected torch.float32"),
            "too many rows": (rows(5), r"has 5 rows; this batcher takes 1..4"),
            "structure": ((rows(1), rows(1)), "structure"),
            "not a tensor": ([1.0], "is list, expected a tensor|structure"),
        }
        for x, message in bad.values():
            args = x if isinstance(x, tuple) else (x,)
            with pytest.raises(cg.InputMismatchError, match=message):
                batcher.submit(*args)
        gate.open.set()
        for f in good:
            torch.testing.assert_close(f.result(5).shape, torch.Size([1, 4]))
    assert batcher.metrics().errors["InputMismatchError"] == len(bad)


def test_plain_arguments_follow_the_frozen_value_rule() -> None:
    """A plain argument is fixed for a batcher, compared as graphs compare frozen values: the
    same type and an equal value (1 is not True)."""

    def scaled(x: torch.Tensor, double: bool) -> torch.Tensor:
        return model(x) * (2 if double else 1)

    with cg.Batcher(scaled, rows(1), True, max_batch=4, max_wait_ms=1) as batcher:
        x = rows(2)
        torch.testing.assert_close(batcher.run(x, True, timeout=5), scaled(x, True))
        for other in (False, 1):
            with pytest.raises(cg.InputMismatchError, match="fixed for a batcher"):
                batcher.submit(x, other)


def test_a_full_queue_refuses_at_once() -> None:
    gate = Gate()
    batcher = cg.Batcher(gate, rows(1), max_batch=1, max_queue=2, max_wait_ms=0)
    running = batcher.submit(rows(1))
    assert gate.entered.wait(5)
    queued = [batcher.submit(rows(1)) for _ in range(2)]
    start = time.perf_counter()
    with pytest.raises(cg.Overloaded, match="max_queue=2"):
        batcher.submit(rows(1))
    assert time.perf_counter() - start < 0.5
    gate.open.set()
    for f in [running, *queued]:
        f.result(5)
    batcher.close()
    assert batcher.metrics().errors == {"Overloaded": 1}


def test_a_request_past_its_deadline_is_failed_not_run() -> None:
    gate = Gate()
    batcher = cg.Batcher(gate, rows(1), max_batch=1, max_wait_ms=0)
    batcher.submit(rows(1))
    assert gate.entered.wait(5)
    late = batcher.submit(rows(1), deadline_s=0.05)
    patient = batcher.submit(rows(1), deadline_s=30)
    time.sleep(0.1)
    gate.open.set()
    with pytest.raises(cg.DeadlineExceeded, match="past its deadline"):
        late.result(5)
    patient.result(5)
    batcher.close()
    assert gate.batches == [1, 1]  # the late request never reached the function


def test_a_cancelled_request_is_removed() -> None:
    gate = Gate()
    batcher = cg.Batcher(gate, rows(1), max_batch=8, max_wait_ms=0)
    batcher.submit(rows(1))
    assert gate.entered.wait(5)
    dropped, kept = batcher.submit(rows(3)), batcher.submit(rows(2))
    assert dropped.cancel()
    gate.open.set()
    kept.result(5)
    batcher.close()
    assert gate.batches == [1, 2] and dropped.cancelled()


def test_asyncio_callers_and_cancellation() -> None:
    async def main() -> None:
        gate = Gate()
        async with cg.Batcher(gate, rows(1), max_batch=16, max_wait_ms=5) as batcher:
            blocker = asyncio.ensure_future(batcher(rows(1)))
            await asyncio.to_thread(gate.entered.wait, 5)
            xs = [rows(n) for n in (1, 2, 3)]
            tasks = [asyncio.ensure_future(batcher(x)) for x in xs]
            doomed = asyncio.ensure_future(batcher(rows(4)))
            await asyncio.sleep(0.01)
            doomed.cancel()
            await asyncio.sleep(0.01)
            gate.open.set()
            for x, y in zip(xs, await asyncio.gather(*tasks)):
                torch.testing.assert_close(y, model(x))
            await blocker
            assert gate.batches == [1, 6]  # the cancelled 4 rows never ran

    asyncio.run(main())


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_with_requests_in_flight_answers_or_fails_each_exactly_once(drain: bool) -> None:
    gate = Gate()
    batcher = cg.Batcher(gate, rows(1), max_batch=2, max_wait_ms=0)
    in_flight = batcher.submit(rows(2))
    assert gate.entered.wait(5)
    queued = [batcher.submit(rows(1)) for _ in range(5)]
    closer = threading.Thread(target=batcher.close, kwargs={"drain": drain})
    closer.start()
    deadline = time.perf_counter() + 5
    while "closed" not in repr(batcher) and time.perf_counter() < deadline:
        time.sleep(0.001)  # until close() has stopped intake (it then waits for the worker)
    with pytest.raises(cg.BatcherClosed):
        batcher.submit(rows(1))
    gate.open.set()
    closer.join(5)
    assert not closer.is_alive()
    in_flight.result(0)  # the batch already running is always answered
    outcomes = [f.exception(0) for f in queued]
    if drain:
        assert outcomes == [None] * 5
    else:
        assert all(isinstance(e, cg.BatcherClosed) for e in outcomes)
    assert all(f.done() for f in queued)


def test_a_batcher_no_one_holds_is_collected_once_idle_and_its_worker_ends() -> None:
    # A request queued just before the last reference goes is answered; then the batcher
    # (and the function it serves) is freed and its worker ends.
    gate = Gate()
    batcher = cg.Batcher(gate, rows(1), max_batch=4, max_wait_ms=1, name="dropped")
    x = rows(2)
    answer = batcher.submit(x)
    collected, served = weakref.ref(batcher), weakref.ref(gate)
    del batcher, gate
    served().open.set()
    torch.testing.assert_close(answer.result(10), model(x))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (collected() is not None or _worker("dropped")):
        gc.collect()
        time.sleep(0.02)
    gc.collect()
    assert collected() is None and served() is None
    assert not _worker("dropped")


def _worker(name: str) -> bool:
    return any(
        t.name == f"cudagraphs-batcher-{name}" and t.is_alive() for t in threading.enumerate()
    )


def test_a_failing_function_fails_its_batch_only() -> None:
    calls = []

    def flaky(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if len(calls) == 1:
            raise ValueError("boom")
        return model(x)

    with cg.Batcher(flaky, rows(1), max_batch=4, max_wait_ms=0) as batcher:
        with pytest.raises(ValueError, match="boom"):
            batcher.run(rows(2), timeout=5)
        torch.testing.assert_close(batcher.run(rows(1), timeout=5).shape, torch.Size([1, 4]))


def test_outputs_without_a_batch_dimension_are_refused_with_the_reason() -> None:
    batcher = cg.Batcher(lambda x: x.sum(), rows(1), max_batch=4)
    with batcher, pytest.raises(cg.ConfigError, match="needs the batch as its first dimension"):
        batcher.run(rows(2), timeout=5)


def test_configuration_mistakes_are_refused() -> None:
    with pytest.raises(cg.ConfigError, match="needs max_batch"):
        cg.Batcher(model, rows(1))
    with pytest.raises(cg.ConfigError, match="max_queue must be a positive int"):
        cg.Batcher(model, rows(1), max_batch=2, max_queue=0)
    with pytest.raises(cg.ConfigError, match="0-dim tensor"):
        cg.Batcher(model, torch.tensor(1.0), max_batch=2)


def test_prometheus_text_is_well_formed_and_counts_agree() -> None:
    with cg.Batcher(model, rows(1), max_batch=4, max_wait_ms=0, name='m"1') as batcher:
        for n in (1, 2, 4):
            batcher.run(rows(n), timeout=5)
        with pytest.raises(cg.InputMismatchError):
            batcher.submit(rows(9))
    text = batcher.prometheus()
    sample = re.compile(r'^cudagraphs_batcher_\w+\{batcher="m\\"1"(,\w+="[^"]*")?\} \S+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    assert 'cudagraphs_batcher_requests_total{batcher="m\\"1"} 3' in text
    assert 'kind="InputMismatchError"} 1' in text
    metrics = batcher.metrics()
    assert metrics.latency_p50_s <= metrics.latency_p99_s
    assert metrics.overhead_per_request_s >= 0 and metrics.requests_per_s > 0


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8), min_size=1, max_size=24),
    threads=st.integers(1, 4),
    wait_ms=st.sampled_from([0.0, 1.0, 5.0]),
)
def test_any_arrival_order_and_sizes_give_each_caller_its_rows(sizes, threads, wait_ms) -> None:
    """Requests of random sizes from several threads at once: every answer equals the function
    on that request alone, nothing is lost, and no batch exceeds max_batch."""
    seen: list[int] = []

    def recording(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return model(x)

    requests = [rows(n) for n in sizes]
    answers: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batcher = cg.Batcher(recording, rows(1), max_batch=8, max_wait_ms=wait_ms)

    def client(k: int) -> None:
        for i in range(k, len(requests), threads):
            answers[i] = batcher.run(requests[i], timeout=10)

    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    batcher.close()
    assert sorted(answers) == list(range(len(requests)))
    for i, x in enumerate(requests):
        torch.testing.assert_close(answers[i], model(x))
    assert max(seen) <= 8 and sum(seen) == sum(sizes)


def test_requests_are_checked_against_the_request_device() -> None:
    # A server parses requests on the host: request_device says where they must arrive; a
    # request elsewhere fails alone, naming the device expected.
    with cg.Batcher(model, rows(1), max_batch=4, max_wait_ms=0, request_device="cpu") as batcher:
        x = rows(3)
        torch.testing.assert_close(batcher.run(x, timeout=10), model(x))
    batcher = cg.Batcher(model, rows(1), max_batch=4, request_device="meta")
    with pytest.raises(cg.InputMismatchError, match=r"expected torch\.float32 on meta"):
        batcher.submit(rows(2))
    batcher.close()
