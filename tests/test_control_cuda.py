"""cg.while_loop and cg.cond captured into CUDA conditional nodes: exact trip counts, an RL
rollout until every environment is done, branches taken exactly when eager takes them with no
host sync, and the errors for a body that syncs or a condition of the wrong kind."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import cudagraphs as cg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from rollout_until_done import rollout  # the example's own rollout

pytestmark = pytest.mark.cuda

MAX = 12


def count_up(stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def more(i: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return i < stop

    def step(i: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, total + i

    start = torch.zeros((), dtype=torch.int64, device=stop.device)
    return cg.while_loop(more, step, (start, start.clone()), max_iterations=MAX)


def test_trip_counts_from_zero_past_the_maximum_are_exact() -> None:
    g = cg.graph(count_up, torch.tensor(3, device="cuda"))
    assert g.state is cg.State.CAPTURED
    reserved = torch.cuda.memory_reserved()
    for stop in [*range(MAX + 3), *random.Random(0).sample(range(MAX + 3), MAX + 3)]:
        i, total = g(torch.tensor(stop, device="cuda"))
        trips = min(stop, MAX)
        assert (int(i), int(total)) == (trips, sum(range(trips))), f"stop={stop}"
    assert torch.cuda.memory_reserved() == reserved, "the loop's memory is reused, not grown"


def test_a_bodys_temporaries_are_the_graphs_memory() -> None:
    """A body's intermediate tensors come from the graph's pool. Were they taken from the
    general pool during the capture, that memory would be free again afterwards: eager tensors
    made then (here filled with NaNs, in the sizes of the body's temporaries) would sit where
    every replay writes. They stay NaN, and the replays stay exact."""
    weight = torch.randn(64, 64, device="cuda") / 8

    def mix(x: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def more(y: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return i < steps

        def step(y: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = torch.tanh(y @ weight) * 0.5  # temporaries of 8 KiB and 512 B
            return (y + hidden.sum(-1, keepdim=True) / 64).clone(), i + 1

        start = torch.zeros((), dtype=torch.int64, device=x.device)
        return cg.while_loop(more, step, (x, start), max_iterations=40)

    g = cg.graph(mix, torch.randn(32, 64, device="cuda"), torch.tensor(5, device="cuda"))
    litter = [torch.full((n, 64), float("nan"), device="cuda") for n in (32, 1) * 64]
    for trips in (1, 7, 40):
        x = torch.randn(32, 64, device="cuda")
        steps = torch.tensor(trips, device="cuda")
        got = g(x, steps)
        torch.cuda.synchronize()
        assert all(bool(scrap.isnan().all()) for scrap in litter), (
            "a replay wrote over eager memory"
        )
        want = mix(x, steps)  # eager: a Python loop
        torch.testing.assert_close(got[0], want[0])
        assert int(got[1]) == trips


def test_an_rl_rollout_until_done_equals_eager() -> None:
    torch.manual_seed(0)
    example = (torch.zeros(256, device="cuda"), torch.rand(256, device="cuda") + 0.05)
    g = cg.graph(rollout, *example)
    for _ in range(5):
        position = torch.rand(256, device="cuda") * 5
        velocity = torch.rand(256, device="cuda") * 0.5 + 0.02
        want_p, want_steps = rollout(position, velocity)  # eager: a Python loop
        got_p, got_steps = g(position, velocity)
        torch.testing.assert_close(got_p, want_p, rtol=0, atol=0)
        assert torch.equal(got_steps, want_steps)
        assert int(want_steps.max()) > 1, "the episodes should take several steps"


def pick(x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    return cg.cond(flag, lambda t: t * 2 + 1, lambda t: t.sin(), (x,))


def test_cond_takes_each_branch_exactly_when_eager_does_without_a_host_sync() -> None:
    g = cg.graph(pick, torch.randn(64, device="cuda"), torch.tensor(True, device="cuda"))
    rng = random.Random(1)
    calls = [
        (torch.randn(64, device="cuda"), torch.tensor(rng.random() < 0.5, device="cuda"))
        for _ in range(40)
    ]
    torch.cuda.synchronize()
    outputs = []
    torch.cuda.set_sync_debug_mode("error")  # any host sync in a call raises
    try:
        for x, flag in calls:
            outputs.append(g(x, flag).clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for (x, flag), got in zip(calls, outputs):
        torch.testing.assert_close(got, pick(x, flag), rtol=0, atol=0)
    assert {bool(flag) for _, flag in calls} == {True, False}


def test_a_body_that_syncs_with_the_host_fails_capture_with_the_reason() -> None:
    def syncs(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def body(t: torch.Tensor) -> torch.Tensor:
            return t + float(t.sum().item() > 0)  # a host read inside the loop

        return cg.while_loop(lambda t: t.sum() < 100, body, (x,), max_iterations=4)

    with pytest.raises(cg.CaptureError):
        cg.graph(syncs, torch.ones(4, device="cuda"))
    # The process stays usable: a correct loop captures and replays afterwards.
    g = cg.graph(count_up, torch.tensor(2, device="cuda"))
    assert int(g(torch.tensor(5, device="cuda"))[0]) == 5


def test_a_condition_of_the_wrong_kind_is_refused_with_the_reason() -> None:
    def bad(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cg.while_loop(lambda t: t.sum(), lambda t: t + 1, (x,), max_iterations=3)

    with pytest.raises(cg.CudaGraphsError, match=r"0-dim torch\.bool"):
        cg.graph(bad, torch.ones(4, device="cuda"))


def test_a_condition_on_the_host_is_refused_with_the_reason() -> None:
    def host_condition(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cg.while_loop(lambda t: torch.tensor(True), lambda t: t + 1, (x,), max_iterations=2)

    with pytest.raises(cg.CudaGraphsError, match=r"on cpu"):
        cg.graph(host_condition, torch.ones(4, device="cuda"))
