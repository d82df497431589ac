"""cg.while_loop and cg.cond outside a capture (CPU, eager): the same results as a Python loop
and branch, exact trip counts, and the errors for conditions and states that a loop on the
device could not take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cudagraphs as cg

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


@settings(max_examples=40, deadline=None)
@given(stop=st.integers(0, 20), limit=st.integers(1, 12))
def test_trip_counts_are_exact(stop: int, limit: int) -> None:
    def more(i: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return i < stop

    def step(i: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, total + i

    i, total = cg.while_loop(more, step, (torch.tensor(0), torch.tensor(0)), max_iterations=limit)
    trips = min(stop, limit)
    assert int(i) == trips and int(total) == sum(range(trips))


def test_a_loop_inside_a_graphed_function_runs_as_python_without_cuda() -> None:
    def rollout(position: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        def alive(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return (p < 10).any()

        def step(p: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            moving = p < 10
            return p + v * moving, v

        return cg.while_loop(alive, step, (position, velocity), max_iterations=50)[0]

    position, velocity = torch.zeros(6), torch.rand(6) + 0.5
    g = cg.graph(rollout, position, velocity)
    expected = position.clone()
    while (expected < 10).any():
        expected = expected + velocity * (expected < 10)
    torch.testing.assert_close(g(position, velocity), expected)
    assert torch.equal(position, torch.zeros(6)), "the inputs are not written"


def test_cond_takes_the_branch_eager_takes() -> None:
    x = torch.randn(5)
    for value in (True, False):
        got = cg.cond(torch.tensor(value), lambda t: t * 2, lambda t: t - 1, (x,))
        torch.testing.assert_close(got, x * 2 if value else x - 1)


@pytest.mark.parametrize(
    "pred, shown",
    [
        (True, "gave bool"),
        (torch.tensor(1.0), "torch.float32 tensor of shape ()"),
        (torch.tensor([True]), "shape (1,)"),
    ],
)
def test_conditions_must_be_0_dim_bool_tensors(pred: object, shown: str) -> None:
    with pytest.raises(cg.InputMismatchError, match=r"pred gave") as raised:
        cg.cond(pred, lambda: 1, lambda: 0)  # type: ignore[arg-type]
    assert shown in str(raised.value) and "0-dim torch.bool" in str(raised.value)
    with pytest.raises(cg.InputMismatchError, match="cond_fn gave"):
        cg.while_loop(lambda x: pred, lambda x: x, (torch.zeros(1),), max_iterations=2)


def test_a_body_that_changes_the_state_layout_is_refused() -> None:
    with pytest.raises(
        cg.InputMismatchError, match=r"state\[0\] from body_fn is torch.float32 \(2,\)"
    ):
        cg.while_loop(
            lambda x: x.sum() < 3, lambda x: torch.cat([x, x]), (torch.zeros(1),), max_iterations=3
        )
    with pytest.raises(cg.InputMismatchError, match="returned 1 values for a state of 2"):
        cg.while_loop(
            lambda a, b: a < 1, lambda a, b: a + 1, (torch.tensor(0), torch.tensor(0)),
            max_iterations=3,
        )  # fmt: skip


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_iterations_is_a_positive_int(bad: object) -> None:
    with pytest.raises(cg.ConfigError, match="max_iterations"):
        cg.while_loop(lambda x: x < 1, lambda x: x + 1, (torch.tensor(0),), max_iterations=bad)  # type: ignore[arg-type]


def test_a_machine_without_cuda_12_4_is_told_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudagraphs.control import conditional

    conditional.available.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(conditional, "versions", lambda: (12020, 12080))
    try:
        reason = conditional.available()
        assert reason is not None and "driver is 12.2" in reason and "12.4 or newer" in reason
        with pytest.raises(cg.ConditionalNodesUnavailable, match=r"12\.4"):
            conditional.prepare(torch.device("cuda", 0))
    finally:
        conditional.available.cache_clear()


def test_without_cuda_bindings_the_reason_names_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from cudagraphs.control import conditional

    conditional.available.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as if not installed
    try:
        assert "cuda-bindings" in (conditional.available() or "")
    finally:
        conditional.available.cache_clear()


def test_a_body_routes_allocations_once_and_gives_back_what_it_took(monkeypatch) -> None:
    """The allocator bookkeeping around conditional bodies: the capture's own routing is
    replaced once (however many bodies), and after the capture the routing and the pool
    reference taken for it are given back, so the pool lives exactly as long as the graph."""
    from cudagraphs.core.active_capture import active_capture, capturing

    calls: list[tuple[str, int, object]] = []

    def record(name: str, fails: bool = False):
        def call(device: int, pool: object) -> None:
            calls.append((name, device, pool))
            if fails:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

        return call

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", record("end"), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_beginAllocateToPool", record("begin"), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", record("release"), raising=False)
    assert active_capture() is None
    with capturing((0, 7), 1) as active:
        assert active_capture() is active
        active.route_all_allocations()
        active.route_all_allocations()  # a second body: nothing more to do
        assert calls == [("end", 1, (0, 7)), ("begin", 1, (0, 7))]
        # capture_end already removed the routing: the end inside finish() fails, quietly
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", record("end", fails=True))
        active.finish()
        active.finish()  # idempotent
    assert active_capture() is None
    assert calls[2:] == [("end", 1, (0, 7)), ("release", 1, (0, 7))]


def test_the_capture_names_its_pool_before_it_begins(monkeypatch) -> None:
    """Code recorded inside a capture finds the capture's pool (a graph's own pool() is unknown
    until its capture ended), and the capture ends and gives back the body routing even when
    the function fails."""
    import contextlib

    from cudagraphs.core import recording
    from cudagraphs.core.active_capture import active_capture

    events: list[object] = []

    class FakeGraph:
        def capture_begin(self, pool: object, capture_error_mode: str) -> None:
            events.append(("begin", pool))

        def capture_end(self) -> None:
            events.append("end")

        def reset(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 42))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
    monkeypatch.setattr(recording, "_recover", lambda *_: None)
    routing: list[str] = []
    monkeypatch.setattr(
        torch._C, "_cuda_endAllocateToPool", lambda *_: routing.append("end"), raising=False
    )
    monkeypatch.setattr(
        torch._C, "_cuda_beginAllocateToPool", lambda *_: routing.append("begin"), raising=False
    )
    monkeypatch.setattr(
        torch._C, "_cuda_releasePool", lambda *_: routing.append("release"), raising=False
    )
    stream = type("Stream", (), {"device": torch.device("cuda", 0)})()

    def body_then_fail() -> None:
        seen = active_capture()
        assert seen is not None and seen.pool == (0, 42) and seen.device_index == 0
        seen.route_all_allocations()  # as a loop's body does
        raise ValueError("the function failed")

    with pytest.raises(cg.CaptureError):
        recording.capture_call(
            body_then_fail, (), {}, recording.RecordingSetup(stream, None, "global")
        )
    assert events == [("begin", (0, 42)), "end"]
    assert routing == ["end", "begin", "end", "release"]
    assert active_capture() is None
