"""Training API on the CPU: the eager pass-through, optimizer checks, guards, errors."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphs as cg
from cudagraphs.core.guards import modules_of
from cudagraphs.training.activations import ActivationOrder
from cudagraphs.training.optimizers import OptimizerWatch, make_graph_safe
from cudagraphs.training.schedules import DeviceHyperparameters


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def make_step(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def test_train_step_without_cuda_trains_exactly_like_eager() -> None:
    model, reference = mlp(), mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    step = cg.train_step(make_step(model, opt), optimizer=opt)
    ref_step = make_step(reference, ref_opt)
    data = [(torch.randn(32, 8), torch.randint(0, 4, (32,))) for _ in range(6)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in data:
            loss = step(x, y)
            ref_loss = ref_step(x, y)
    assert any("runs eagerly" in str(w.message) for w in caught)
    assert step.state is cg.State.EAGER and step.stats.eager_calls == 6
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # The optimizer was left as it was: nothing to make graph-safe without CUDA.
    assert isinstance(opt.param_groups[0]["lr"], float)


def test_train_step_decorator_form_and_repr() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @cg.train_step(optimizer=[opt], warmup=2)
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss

    assert isinstance(step, cg.TrainStep)
    assert "SGD" in repr(step) and step.warmups_left == step.warmup == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(optimizer="adam"), "optimizer must be a torch.optim.Optimizer"),
        (dict(optimizer=[]), "optimizer must be a torch.optim.Optimizer"),
        (dict(optimizer=None, warmup=0), "optimizer must be"),
        (dict(warmup=0), "warmup >= 1"),
        (dict(warmup=-1), "warmup must be an int"),
        (dict(outputs="copy"), "outputs must be one of"),
        (dict(on_stale="ignore"), "on_stale must be one of"),
    ],
)
def test_train_step_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    kwargs = {"optimizer": opt, **kwargs}
    with pytest.raises(cg.ConfigError, match=match) as caught:
        cg.train_step(lambda: None, **kwargs)
    assert "Fix:" in str(caught.value) or "fix" in str(caught.value).lower()


def test_train_step_refuses_a_non_callable() -> None:
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(cg.ConfigError, match="callable step function"):
        cg.train_step(42, optimizer=opt)  # type: ignore[call-overload]


def test_make_graph_safe_refuses_without_changing_anything() -> None:
    model = mlp()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(cg.ConfigError, match="no graph-safe mode"):
        make_graph_safe(lbfgs)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(cg.ConfigError, match="create it with fused=True"):
        make_graph_safe(adam, switch=False)
    rmsprop = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    with pytest.raises(cg.ConfigError, match="create it with capturable=True"):
        make_graph_safe(rmsprop, switch=False)
    differentiable = torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True)
    with pytest.raises(cg.ConfigError, match="differentiable=True"):
        make_graph_safe(differentiable)
    # CPU parameters: refused, and the optimizer is untouched (no half-applied switch).
    with pytest.raises(cg.ConfigError, match=r"parameters on \[.cpu.\]|needs a CUDA GPU"):
        make_graph_safe(adam)
    assert adam.param_groups[0]["fused"] is None and isinstance(adam.param_groups[0]["lr"], float)
    with pytest.raises(cg.ConfigError, match=r"must be a torch\.optim\.Optimizer"):
        make_graph_safe(model)  # type: ignore[arg-type]


def test_optimizer_watch_notices_what_a_recording_would_ignore() -> None:
    model = mlp()
    opt = torch.optim.Adam(
        model.parameters(), lr=torch.tensor(1e-3), capturable=False, foreach=False
    )
    watch = OptimizerWatch(opt)
    assert watch.stale() is None
    opt.param_groups[0]["lr"].fill_(5e-4)  # what a scheduler does: in place, still valid
    assert watch.stale() is None
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    assert "betas" in watch.stale()
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    assert watch.stale() is None
    hyperparameters = DeviceHyperparameters(opt)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 1e-3  # a hand-written schedule: refreshed before the replay
    assert watch.stale() is None
    hyperparameters.refresh()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-3)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert "load_state_dict" in watch.stale()
    watch._record()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert "add_param_group" in watch.stale()


def test_guards_find_modules_a_step_function_reads_from_its_closure() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_step(model, opt)
    assert modules_of(step) == [model]


def test_chain_order_rules() -> None:
    order = ActivationOrder(2)
    a = order.forward(0, expects_backward=True)
    b = order.forward(1, expects_backward=True)
    order.backward(1, b, "second")
    order.backward(0, a, "first")  # forward 1..n then backward n..1: fine
    a = order.forward(0, expects_backward=True)
    order.backward(0, a, "first")
    order.backward(0, a, "first")  # retain_graph: the same activations, still intact
    a = order.forward(0, expects_backward=True)
    order.forward(0, expects_backward=True)
    with pytest.raises(cg.StaleGraphError, match="overwritten"):
        order.backward(0, a, "first")  # a second forward of the same stage
    order = ActivationOrder(2)
    a = order.forward(0, expects_backward=True)
    b = order.forward(1, expects_backward=True)
    order.forward(0, expects_backward=True)
    with pytest.raises(cg.StaleGraphError):
        order.backward(1, b, "second")  # an earlier stage replayed since
    order = ActivationOrder(2)
    a = order.forward(0, expects_backward=True)
    b = order.forward(1, expects_backward=True)
    with pytest.raises(cg.StaleGraphError, match="later stage's backward is still due"):
        order.backward(0, a, "first")
    order = ActivationOrder(2)
    a = order.forward(0, expects_backward=True)
    order.forward(1, expects_backward=False)  # under no_grad: no backward expected
    order.backward(0, a, "first")


def test_graph_autograd_without_cuda_says_so() -> None:
    with pytest.raises(cg.ConfigError, match="needs CUDA"):
        cg.graph_autograd(mlp(), torch.randn(4, 8))


def test_graph_autograd_chain_stage_format_is_checked(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cg.ConfigError, match=r"stages\[0\] must be \(fn, args\)"):
        cg.graph_autograd_chain([mlp()])  # type: ignore[list-item]
    with pytest.raises(cg.ConfigError, match="needs CUDA tensor example inputs"):
        cg.graph_autograd_chain([(mlp(), (torch.randn(4, 8),))])


def side_by_side(
    make: Any, steps: int, *, scheduler: Any = None, maximize: bool = False, watch: Any = None
) -> set[float]:
    """Two copies of one MLP trained on the same batches, ours and torch's optimizer from
    ``make(params_ours, params_theirs)``, each with its own ``scheduler(opt)``; their parameters
    must agree at the end. Returns the values ``watch(our_optimizer)`` took."""
    ours, theirs = mlp(), mlp()
    theirs.load_state_dict(ours.state_dict())
    opts = make(ours.parameters(), theirs.parameters())
    schedules = [scheduler(o) for o in opts] if scheduler is not None else []
    seen = set()
    for _ in range(steps):
        x = torch.randn(16, 8)
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss = model(x).square().mean()
            (-loss if maximize else loss).backward()  # bounded either way
            opt.step()
        for schedule in schedules:
            schedule.step()
        if watch is not None:
            seen.add(round(watch(opts[0]), 6))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return seen


@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.9},
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2},
        {"momentum": 0.8, "nesterov": True, "maximize": True},
        {},
    ],
)
def test_graph_safe_sgd_steps_as_torch_sgd_does(settings: dict) -> None:
    torch.manual_seed(0)
    side_by_side(
        lambda ours, theirs: [
            cg.GraphSafeSGD(ours, lr=0.05, **settings),
            torch.optim.SGD(theirs, lr=0.05, **settings),
        ],
        20,
        maximize=settings.get("maximize", False),
    )


def test_graph_safe_sgd_follows_a_momentum_schedule() -> None:
    torch.manual_seed(1)
    seen = side_by_side(
        lambda ours, theirs: [
            cg.GraphSafeSGD(ours, lr=0.05, momentum=0.9),
            torch.optim.SGD(theirs, lr=0.05, momentum=0.9),
        ],
        12,
        scheduler=lambda o: torch.optim.lr_scheduler.CyclicLR(
            o, 0.001, 0.01, step_size_up=3, cycle_momentum=True
        ),
        watch=lambda o: o.param_groups[0]["momentum"],
    )
    assert len(seen) > 3  # the momentum really moved


@pytest.mark.parametrize(
    "settings", [{}, {"weight_decay": 1e-2, "amsgrad": True}, {"maximize": True}]
)
def test_graph_safe_adamw_steps_as_torch_adamw_does(settings: dict) -> None:
    torch.manual_seed(0)
    betas = side_by_side(
        lambda ours, theirs: [
            cg.GraphSafeAdamW(ours, lr=1e-2, **settings),
            torch.optim.AdamW(theirs, lr=1e-2, foreach=False, **settings),
        ],
        25,
        scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=2e-2, total_steps=30, cycle_momentum=True
        ),
        maximize=settings.get("maximize", False),
        watch=lambda o: o.param_groups[0]["betas"][0],
    )
    assert len(betas) > 5  # OneCycleLR really cycled betas[0]


class _Double(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 4), nn.Dropout(0.5))
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.label = "double"


def test_the_graphed_stand_in_shares_the_modules_state_and_leaves_it_alone() -> None:
    from cudagraphs.training.graphed_module import GraphedModule

    module = _Double()
    calls: list[tuple[Any, ...]] = []
    stand_in = GraphedModule(module, lambda *args: calls.append(args) or "replayed")  # type: ignore[arg-type]
    assert "forward" not in vars(module)  # the user's forward is untouched
    assert stand_in(torch.ones(1, 4)) == "replayed" and len(calls) == 1
    assert stand_in.state_dict().keys() == module.state_dict().keys()
    assert all(a is b for a, b in zip(stand_in.parameters(), module.parameters()))
    assert stand_in.label == "double" and stand_in.original is module
    stand_in.eval()
    assert not module.training and not module[1].training and not stand_in.training
    stand_in.train()
    assert module.training and module[1].training
    stand_in.to(torch.float64)  # both see the converted tensors
    assert module[0].weight.dtype == torch.float64 and module.seen.dtype == torch.float64
    saved = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    stand_in.load_state_dict(saved)
    assert torch.equal(module[0].weight, saved["0.weight"])
    parent = nn.Sequential(nn.Identity(), module)
    keys = parent.state_dict().keys()
    parent[1] = stand_in
    assert parent.state_dict().keys() == keys and "graphed" in repr(parent)
    assert "original" not in module._modules and "graphed" not in module._modules
