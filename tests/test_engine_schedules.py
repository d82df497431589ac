"""The engine's scheduler under schedules drawn by hypothesis: requests that arrive at once or
after another request's k-th token, that stop at an end-of-sequence id or at their length,
that are cancelled after a few tokens, greedy beside seeded sampled neighbours, on engines of
few slots, small prompt budgets and several steps per read. Whatever the schedule:

- a greedy request that is not cancelled gets exactly its own ``model.generate`` tokens (the
  model is float32: no tolerance);
- a seeded sampled request gets the tokens it gets alone on the same engine;
- a cancelled request got a prefix of what it would have got, and frees its slot;
- afterwards nothing is running or queued, no error but the cancels was counted, and one more
  request gets its own ``generate`` tokens (a cancel or a move left no slot or cache row
  broken).

The fixed cases in ``test_engine.py`` check each behaviour once; these check them together,
in orders nobody wrote down (a move while a prompt is half in, a cancel during a chunk, a
sampled row joining a greedy batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_engine import model, prompts, recorded_steps, reference  # noqa: E402,F401  (fixtures)

import cudagraphs as cg  # noqa: E402
from cudagraphs.decoding import Engine  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")

MAX_LENGTH = 48


@dataclass(frozen=True)
class Planned:
    """One request of a schedule."""

    length: int  # prompt tokens
    new: int  # max_new_tokens
    stop_at: int | None  # the index of its reference token used as its end-of-sequence id
    seed: int | None  # sampled with this seed; None: greedy
    after: tuple[int, int] | None  # submitted once request j has k tokens (j earlier)
    cancel_after: int | None  # cancelled once it has this many tokens


@st.composite
def schedules(draw: Any) -> tuple[dict[str, Any], list[Planned]]:
    engine = {
        "max_batch": draw(st.integers(1, 4)),
        "prefill_chunk": draw(st.sampled_from([4, 8, 16])),
        "prefill_rows": draw(st.integers(1, 3)),
        "read_every": draw(st.integers(1, 3)),
        "cache_lengths": draw(st.sampled_from([None, [16, 32]])),
    }
    planned = []
    for i in range(draw(st.integers(2, 6))):
        length = draw(st.integers(1, 30))
        new = draw(st.integers(1, MAX_LENGTH - length))
        sampled = draw(st.integers(0, 3)) == 0
        planned.append(
            Planned(
                length=length,
                new=new,
                stop_at=None if sampled or draw(st.booleans()) else draw(st.integers(0, new - 1)),
                seed=draw(st.integers(0, 2**31 - 1)) if sampled else None,
                after=(
                    (draw(st.integers(0, i - 1)), draw(st.integers(1, 6)))
                    if i and draw(st.booleans())
                    else None
                ),
                cancel_after=draw(st.integers(1, 5)) if draw(st.integers(0, 4)) == 0 else None,
            )
        )
    return engine, planned


def submit(engine: Engine, prompt: list[int], plan: Planned, eos: list[int] | None) -> Any:
    extra = {"do_sample": True, "temperature": 1.2, "top_k": 50, "seed": plan.seed} if plan.seed is not None else {}  # fmt: skip
    return engine.submit(prompt, max_new_tokens=plan.new, eos_token_id=eos, **extra)


def run_schedule(engine: Engine, asked: list[list[int]], plans: list[Planned], eos: list[Any]) -> list[Any]:  # fmt: skip
    """Submit and cancel as planned, from this thread while the engine works on its own;
    return every request's completion once each has ended."""
    completions: list[Any] = [None] * len(plans)
    deadline = time.monotonic() + 120
    while not all(c is not None and c.done for c in completions):
        assert time.monotonic() < deadline, "the schedule did not finish in two minutes"
        for i, plan in enumerate(plans):
            if completions[i] is None:
                j, k = plan.after or (None, 0)
                ready = completions[j] if j is not None else None
                if j is None or (ready is not None and (len(ready.tokens) >= k or ready.done)):
                    completions[i] = submit(engine, asked[i], plan, eos[i])
            elif (
                plan.cancel_after is not None
                and not completions[i].done
                and len(completions[i].tokens) >= plan.cancel_after
            ):
                completions[i].cancel()
        time.sleep(0.0005)
    return completions


SCHEDULES = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SCHEDULES
@given(schedule=schedules(), seed=st.integers(0, 10_000))
def test_any_schedule_gives_each_request_its_own_tokens(model, schedule, seed) -> None:  # noqa: F811
    check_schedule(model, schedule, seed)


@pytest.mark.slow  # about 35 s on two cores: each engine records every prompt-chunk rung first
@SCHEDULES
@given(schedule=schedules(), seed=st.integers(0, 10_000))
def test_any_schedule_on_recorded_steps_gives_each_request_its_own_tokens(
    recorded_steps,  # noqa: F811
    model,  # noqa: F811
    schedule,
    seed,
) -> None:
    # The steps and prompt chunks are recordings replayed without Python, as graphs are: a
    # slot, length or mask read on the host at capture would come back frozen.
    check_schedule(model, schedule, seed)


def check_schedule(lm: Any, schedule: tuple[dict[str, Any], list[Planned]], seed: int) -> None:
    settings_, plans = schedule
    asked = prompts(seed, [p.length for p in plans])
    free = [reference(lm, prompt, p.new) for prompt, p in zip(asked, plans)]
    eos = [None if p.stop_at is None else [free[i][p.stop_at]] for i, p in enumerate(plans)]
    with Engine(lm, max_length=MAX_LENGTH, **settings_) as engine:
        completions = run_schedule(engine, asked, plans, eos)
        alone = {
            i: submit(engine, asked[i], p, None).result(timeout=120)
            for i, p in enumerate(plans)
            if p.seed is not None
        }
        for i, (plan, completion) in enumerate(zip(plans, completions)):
            if plan.seed is None:
                expected = reference(lm, asked[i], plan.new, eos=eos[i])
            else:
                expected = alone[i]
            got = completion.tokens
            if completion.finish_reason == "cancelled":
                assert plan.cancel_after is not None
                assert got == expected[: len(got)], f"request {i} (cancelled): {plan}"
                with pytest.raises(cg.RequestCancelled):
                    completion.result(timeout=1)
            else:
                assert completion.result(timeout=1) == expected, f"request {i}: {plan}"
                assert completion.finish_reason == (
                    "stop" if eos[i] is not None and expected[-1] in eos[i] else "length"
                )
        metrics = engine.metrics()
        assert metrics.running == 0 and metrics.queue_depth == 0
        cancels = sum(c.finish_reason == "cancelled" for c in completions)
        assert metrics.errors == ({"RequestCancelled": cancels} if cancels else {})
        assert metrics.requests == len(plans) + len(alone)
        # The slots and cache rows every cancel and move left behind serve a new request.
        last = prompts(seed + 1, [MAX_LENGTH // 2])[0]
        after = engine.submit(last, max_new_tokens=MAX_LENGTH // 2, eos_token_id=None)
        assert after.result(timeout=120) == reference(lm, last, MAX_LENGTH // 2)
