"""Modules held outside a module are guarded as a module's are: an RL policy as a plain object
of the user's class with ``__call__`` (its networks are attributes or dict entries), and a
module global a step function reads. Before, neither was found: a replaced network, parameter
or ``.data``, a plain value of the policy or of a dict it holds, or a global bound to another
module, replayed the recorded answer. On the CPU the stand-in freezes
like a graph (conftest.py), so the old answer would show here; the GPU versions are in
test_held_modules_cuda.py."""

from __future__ import annotations

import functools

import pytest
import torch
import value_cases
from reads_cases import answers_as_eager_after
from torch import nn
from value_cases import (
    PARTIAL_CHANGES,
    POLICY_CHANGES,
    HoldsStep,
    Policy,
    bound_step,
    step_with_net,
)

import cudagraphs as cg


@pytest.mark.parametrize("kind", list(POLICY_CHANGES))
def test_a_policy_objects_changed_network_gives_eager_s_answer(stand_in: None, kind: str) -> None:
    torch.manual_seed(0)
    policy = Policy()
    x = torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(policy, x)
        torch.testing.assert_close(g(x), policy(x))
        POLICY_CHANGES[kind](policy)
        fresh = torch.randn(4, 8)
        torch.testing.assert_close(g(fresh), policy(fresh))  # not the recorded weights' answer
        assert g.stats.recaptures == 1
        torch.testing.assert_close(g(x), policy(x))
        assert g.stats.recaptures == 1


def test_a_policy_objects_weights_updated_in_place_replay_without_recapture(
    stand_in: None,
) -> None:
    torch.manual_seed(0)
    policy = Policy()
    x = torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(policy, x)
        assert g.stats.guarded_tensors >= 6  # the three networks' weights and biases
        policy.head.weight.mul_(2.0)  # an RL weight sync writes in place
        torch.testing.assert_close(g(x), policy(x))
        assert g.stats.recaptures == 0


def test_a_module_global_bound_to_another_module_gives_eager_s_answer(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(step_with_net, x)
        torch.testing.assert_close(g(x), step_with_net(x))
        monkeypatch.setattr(value_cases, "NET", nn.Linear(8, 8).requires_grad_(False))
        torch.testing.assert_close(g(x), step_with_net(x))  # not the old module's answer
        assert g.stats.recaptures == 1


def _scaled(model: nn.Module, x: torch.Tensor, *, scale: float) -> torch.Tensor:
    return model(x) * scale


def test_a_module_bound_to_a_partial_is_guarded(stand_in: None) -> None:
    """``functools.partial(step, model, scale=...)``: a module bound to the partial is read by
    the graph."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8).requires_grad_(False)
    step = functools.partial(_scaled, model, scale=1.0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(step, x)
        model.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
        torch.testing.assert_close(g(x), step(x))
        assert g.stats.recaptures == 1
        model.weight.mul_(2.0)  # in place: replayed as it is, no capture
        torch.testing.assert_close(g(x), step(x))
        assert g.stats.recaptures == 1


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("held", ["graphed", "attribute"])
@pytest.mark.parametrize("change", list(PARTIAL_CHANGES))
def test_a_value_bound_to_a_partial_and_changed_gives_eager_s_answer(
    stand_in: None, change: str, held: str, compile: bool
) -> None:
    """``p.keywords["scale"] = 2.0`` after the capture, on the graphed partial itself or on one
    a model holds: captured again, eager's answer. Under ``compile=True`` the partial's
    function never runs as Python during the capture (Dynamo runs its trace); what the partial
    binds is still among what the guard checks, and Dynamo, whose own guards see the change,
    traces again; where the partial itself is compiled, Dynamo wraps it in a function of its
    own. The stand-in replays the recorded operations like a graph: a missed change would
    give the recorded answer."""
    step, mix = bound_step(change)
    graphed = HoldsStep(step) if held == "attribute" else step
    with torch.no_grad():
        answers_as_eager_after(
            graphed, lambda _: PARTIAL_CHANGES[change](step, mix), compile=compile
        )
