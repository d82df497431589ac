"""Values a recording read from somewhere other than the instance's own attributes: the
class (a class-level default, a method), a base class, and the items of a list. Each change
after the capture must give eager's answer through one new capture, never the recorded one.
On the CPU the stand-in (conftest.py) replays the logged operations without running the
function, so a value the guard missed would give the old answer here as in a graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reads_cases import answers_as_eager_after
from value_cases import (
    BEYOND_ATTRIBUTES,
    HELD_TENSORS,
    REBOUND_HOLDERS,
    Configured,
    DefaultedChild,
    GreedyPolicy,
    Holding,
    Policy,
)

import cudagraphs as cg


@pytest.mark.parametrize("case", list(BEYOND_ATTRIBUTES))
def test_a_value_read_beyond_the_instance_changed_after_capture_gives_eager_s_answer(
    stand_in: None, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = DefaultedChild()
    g = cg.graph(model, torch.randn(4, 8), outputs="clone")
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), model(x))
    fresh = torch.randn(4, 8)
    recorded = model(fresh)  # what a replay that missed the change would give
    change, name = BEYOND_ATTRIBUTES[case]
    change(model, monkeypatch)
    expected = model(fresh)
    assert not torch.allclose(expected, recorded)  # the change matters to the answer
    torch.testing.assert_close(g(fresh), expected)
    assert g.stats.recaptures == 1
    assert any(name in notice for notice in g.stats.notices), g.stats.notices
    again = torch.randn(4, 8)
    torch.testing.assert_close(g(again), model(again))
    assert g.stats.recaptures == 1  # the new value is the recorded one now


@pytest.mark.parametrize("case", list(HELD_TENSORS))
def test_a_tensor_or_module_held_outside_the_module_tree_changed_after_capture(
    stand_in: None, case: str
) -> None:
    """Tensors a forward reads that are not parameters or buffers (an attribute, a dict or list
    item), a module in a plain list, a buffer registered later: the recording read them by
    address, so another object there (an equal one too) or new memory must capture again."""
    torch.manual_seed(0)
    _captures_again_for(Holding(), *HELD_TENSORS[case])


def _captures_again_for(model: torch.nn.Module, change: Any, name: str) -> None:
    """Capture ``model``, make the change, and check the next call answers as eager through
    one new capture whose notice names ``name``."""
    answers_as_eager_after(model, change, name)


@pytest.mark.parametrize("case", list(REBOUND_HOLDERS))
def test_an_object_the_forward_reads_values_through_rebound_after_capture(
    stand_in: None, case: str
) -> None:
    """A config dataclass, a namespace or a dict whose values the forward reads, replaced by
    another one: the watch held the old object's values, so the object itself is held by
    identity too."""
    torch.manual_seed(0)
    _captures_again_for(Configured(), *REBOUND_HOLDERS[case])


def test_a_policy_object_given_another_class_after_capture_gives_eager_s_answer(
    stand_in: None,
) -> None:
    """An object of the user's own class called as the function (an RL policy): swapping its
    class (``policy.__class__ = Other``) gives it another ``__call__``; the value watch holds
    the class of such objects, as the address guard does each module's."""
    torch.manual_seed(0)
    policy = Policy()
    g = cg.graph(policy, torch.randn(4, 8), outputs="clone")
    obs = torch.randn(4, 8)
    recorded = g(obs)
    policy.__class__ = GreedyPolicy
    assert not torch.allclose(policy(obs), recorded)  # the change matters to the answer
    torch.testing.assert_close(g(obs), policy(obs))
    assert g.stats.recaptures == 1


def _closures() -> tuple[Any, Any, list[torch.Tensor]]:
    """A graphed function reading closure variables: a helper's float, its own list."""
    gain = 2.0
    scales = [torch.ones(8)]

    def helper(x: torch.Tensor) -> torch.Tensor:
        return x * gain

    def fn(x: torch.Tensor) -> torch.Tensor:
        return helper(x) * scales[0]

    def set_gain(value: float) -> None:
        nonlocal gain
        gain = value

    return fn, set_gain, scales


CLOSURE_CHANGES = {
    "a helper's closure variable rebound": lambda set_gain, scales: set_gain(5.0),
    "an item of a list in the closure replaced": lambda set_gain, scales: scales.__setitem__(
        0, torch.full((8,), 3.0)
    ),
}


@pytest.mark.parametrize("case", list(CLOSURE_CHANGES))
def test_a_closure_variable_read_by_the_code_that_ran_changed_after_capture(
    stand_in: None, case: str
) -> None:
    """Closure variables are loaded as free variables, not by name: the cells of every reached
    function whose code ran are held (a helper's too, and a list's items)."""
    fn, set_gain, scales = _closures()
    x = torch.randn(4, 8)
    g = cg.graph(fn, x, outputs="clone")
    recorded = g(x)
    CLOSURE_CHANGES[case](set_gain, scales)
    assert not torch.allclose(fn(x), recorded)  # the change matters to the answer
    torch.testing.assert_close(g(x), fn(x))
    assert g.stats.recaptures == 1
    assert any("closure variable" in notice for notice in g.stats.notices), g.stats.notices
