"""On a GPU, with real graphs: a policy object's networks, a module global a step function
reads and what a partial binds are guarded (see test_held_modules.py): a change after the
capture gives eager's answer, an in-place update replays without a new capture."""

from __future__ import annotations

import pytest
import torch
import value_cases
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

pytestmark = pytest.mark.cuda


def _on_gpu(policy: Policy) -> Policy:
    policy.body, policy.head = policy.body.cuda(), policy.head.cuda()
    policy.extra["critic"] = policy.extra["critic"].cuda()
    return policy


@pytest.mark.parametrize("kind", list(POLICY_CHANGES))
def test_a_policy_objects_changed_network_gives_eager_s_answer(kind: str) -> None:
    torch.manual_seed(0)
    policy = _on_gpu(Policy())
    with torch.no_grad():
        g = cg.graph(policy, torch.randn(64, 8, device="cuda"))
        # The old weights stay alive, so a new one cannot take a freed one's address: with the
        # same address and new contents, a replay would be right without a new capture.
        held = [t.detach() for m in (policy.body, policy.head, policy.extra["critic"])
                for t in m.parameters()]  # fmt: skip
        POLICY_CHANGES[kind](policy)
        _on_gpu(policy)  # a replaced network or parameter comes to the GPU as a user's would
        policy.body.weight.data = policy.body.weight.data.cuda()
        x = torch.randn(64, 8, device="cuda")
        torch.testing.assert_close(g(x), policy(x))  # not the recorded weights' answer
        assert g.stats.recaptures == 1
        x = torch.randn(64, 8, device="cuda")
        torch.testing.assert_close(g(x), policy(x))
        assert g.stats.recaptures == 1 and g.stats.replays >= 1
        del held


def test_a_policy_objects_weights_updated_in_place_replay_without_recapture() -> None:
    torch.manual_seed(0)
    policy = _on_gpu(Policy())
    with torch.no_grad():
        g = cg.graph(policy, torch.randn(64, 8, device="cuda"))
        policy.head.weight.mul_(2.0)
        x = torch.randn(64, 8, device="cuda")
        torch.testing.assert_close(g(x), policy(x))
        assert g.stats.recaptures == 0 and g.stats.replays >= 1


def test_a_module_global_bound_to_another_module_gives_eager_s_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    monkeypatch.setattr(value_cases, "NET", nn.Linear(8, 8).cuda().requires_grad_(False))
    with torch.no_grad():
        g = cg.graph(step_with_net, torch.randn(64, 8, device="cuda"))
        monkeypatch.setattr(value_cases, "NET", nn.Linear(8, 8).cuda().requires_grad_(False))
        x = torch.randn(64, 8, device="cuda")
        torch.testing.assert_close(g(x), step_with_net(x))  # not the old module's answer
        assert g.stats.recaptures == 1


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("held", ["graphed", "attribute"])
@pytest.mark.parametrize("change", list(PARTIAL_CHANGES))
def test_a_value_bound_to_a_partial_and_changed_gives_eager_s_answer(
    change: str, held: str, compile: bool
) -> None:
    torch.manual_seed(0)
    step, mix = bound_step(change, "cuda")
    graphed = HoldsStep(step) if held == "attribute" else step
    kept = step.keywords["net"]  # alive: a new network cannot take its address
    with torch.no_grad():
        g = cg.graph(graphed, torch.randn(64, 8, device="cuda"), compile=compile)
        PARTIAL_CHANGES[change](step, mix)
        x = torch.randn(64, 8, device="cuda")
        torch.testing.assert_close(g(x), graphed(x))  # not the recorded answer
        assert g.stats.recaptures == 1
        x = torch.randn(64, 8, device="cuda")
        torch.testing.assert_close(g(x), graphed(x))
        assert g.stats.recaptures == 1 and g.stats.replays >= 1
    del kept
