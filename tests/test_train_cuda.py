"""Training on a real GPU: whole-step capture and graphed autograd modules against eager."""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphs as cg

pytestmark = pytest.mark.cuda

STEPS = 50


def mlp(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 256), nn.ReLU(), nn.Dropout(dropout), nn.Linear(256, 16)
    ).cuda()


def batches(n: int = STEPS, batch: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [
        (
            torch.randn(batch, 256, device="cuda", generator=g),
            torch.randint(0, 16, (batch,), device="cuda", generator=g),
        )
        for _ in range(n)
    ]


OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
}


def make_step(model: nn.Module, opt: torch.optim.Optimizer, clip: bool):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return loss

    return step


def assert_params_close(a: nn.Module, b: nn.Module, rtol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        relative = ((p - q).norm() / q.norm()).item()
        assert relative <= rtol, f"{name}: relative difference {relative:.2e} > {rtol:.0e}"
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_whole_step_equals_eager_after_50_steps(name: str, clip: bool) -> None:
    torch.manual_seed(0)
    eager_model = mlp()
    graphed_model = copy.deepcopy(eager_model)
    eager_opt = OPTIMIZERS[name](eager_model.parameters())
    graphed_opt = OPTIMIZERS[name](graphed_model.parameters())
    # A schedule that changes the learning rate every 5 steps: the graph must follow it.
    eager_sched = torch.optim.lr_scheduler.StepLR(eager_opt, step_size=5, gamma=0.7)
    graphed_sched = torch.optim.lr_scheduler.StepLR(graphed_opt, step_size=5, gamma=0.7)
    eager_step = make_step(eager_model, eager_opt, clip)
    graphed_step = cg.train_step(make_step(graphed_model, graphed_opt, clip), optimizer=graphed_opt)
    eager_losses, graphed_losses = [], []
    for x, y in batches():
        eager_losses.append(eager_step(x, y).detach().clone())
        graphed_losses.append(graphed_step(x, y).clone())
        eager_sched.step()
        graphed_sched.step()
    assert graphed_step.state is cg.State.CAPTURED
    stats = graphed_step.stats
    assert stats.eager_calls == 3 and stats.replays == STEPS - 3 and stats.recaptures == 0
    torch.testing.assert_close(
        torch.stack(graphed_losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-6
    )
    assert_params_close(graphed_model, eager_model, rtol=1e-5)
    # The learning rate really moved (so the comparison covers the schedule), in place.
    lr = graphed_opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.is_cuda
    assert lr.item() == pytest.approx(eager_opt.param_groups[0]["lr"], rel=1e-6)
    assert lr.item() < OPTIMIZERS[name](nn.Linear(1, 1).parameters()).param_groups[0]["lr"] * 0.1


def test_gradients_live_in_the_pool_and_are_refilled_in_place() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = cg.train_step(make_step(model, opt, clip=False), optimizer=opt, warmup=2)
    data = batches(6)
    for x, y in data[:3]:
        step(x, y)
    pointers = [p.grad.data_ptr() for p in model.parameters()]
    for x, y in data[3:]:
        step(x, y)
    assert [p.grad.data_ptr() for p in model.parameters()] == pointers
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())


def test_dropout_draws_new_masks_each_replay_at_eager_keep_rate() -> None:
    model = mlp(dropout=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        opt.zero_grad()
        mask = F.dropout(torch.ones_like(x), p=0.3) != 0  # the same RNG stream dropout uses
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss, mask

    graphed = cg.train_step(step, optimizer=opt, outputs="clone")
    masks = [graphed(x, y)[1] for x, y in batches(8)]
    replayed = masks[3:]  # the first three were eager warm-up steps
    for a, b in itertools.pairwise(replayed):
        assert not torch.equal(a, b)
    keep = torch.stack(replayed).float().mean().item()
    assert keep == pytest.approx(0.7, abs=0.01)


def test_bf16_autocast_step_matches_eager() -> None:
    torch.manual_seed(0)
    eager_model = mlp()
    graphed_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, fused=True)
    graphed_opt = torch.optim.AdamW(graphed_model.parameters(), lr=1e-3, fused=True)

    def make(model: nn.Module, opt: torch.optim.Optimizer):
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    eager_step, graphed_step = (
        make(eager_model, eager_opt),
        cg.train_step(make(graphed_model, graphed_opt), optimizer=graphed_opt),
    )
    for x, y in batches(20):
        eager_loss = eager_step(x, y)
        graphed_loss = graphed_step(x, y)
    torch.testing.assert_close(graphed_loss, eager_loss.detach(), rtol=1e-3, atol=1e-3)
    assert_params_close(graphed_model, eager_model, rtol=1e-3)


def scaled_fp16_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step


def test_fp16_grad_scaler_with_switched_fused_adam_matches_eager() -> None:
    torch.manual_seed(0)
    eager_model = mlp()
    graphed_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-3, fused=True)
    graphed_opt = torch.optim.Adam(graphed_model.parameters(), lr=1e-3)  # switched to fused
    eager_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    graphed_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)

    eager_step = scaled_fp16_step(eager_model, eager_opt, eager_scaler)
    graphed_step = cg.train_step(
        scaled_fp16_step(graphed_model, graphed_opt, graphed_scaler), optimizer=graphed_opt
    )
    for x, y in batches(20):
        eager_step(x, y)
        graphed_step(x, y)
    assert graphed_step.state is cg.State.CAPTURED and graphed_opt.param_groups[0]["fused"]
    assert graphed_scaler.get_scale() == eager_scaler.get_scale()
    assert_params_close(graphed_model, eager_model, rtol=1e-3)


def test_grad_scaler_without_fused_step_is_a_capture_error_naming_the_sync() -> None:
    model = mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)  # capturable, but has no fused form
    scaler = torch.amp.GradScaler("cuda")
    step = scaled_fp16_step(model, opt, scaler)
    graphed = cg.train_step(step, optimizer=opt, warmup=1)
    data = batches(3)
    graphed(*data[0])
    graphed(*data[1])  # one more eager step: the first began with no gradients to watch
    with pytest.raises(cg.CaptureError) as caught:
        graphed(*data[2])
    assert caught.value.kind == "host-sync"
    assert any(f.kind == "grad-scaler" for f in caught.value.findings), caught.value.findings


def test_lr_assignment_replays_and_load_state_dict_recaptures_correctly(caplog) -> None:
    torch.manual_seed(0)
    eager_model = mlp()
    graphed_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-3)
    graphed_opt = torch.optim.Adam(graphed_model.parameters(), lr=1e-3)
    eager_step = make_step(eager_model, eager_opt, clip=False)
    graphed_step = cg.train_step(
        make_step(graphed_model, graphed_opt, clip=False), optimizer=graphed_opt
    )
    data = batches(20)
    snapshot = None
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        for i, (x, y) in enumerate(data):
            if i == 8:  # a float lr: copied into the tensor the graph reads, no recapture
                eager_opt.param_groups[0]["lr"] = 3e-4
                graphed_opt.param_groups[0]["lr"] = 3e-4
            if i == 12:
                snapshot = copy.deepcopy(eager_opt.state_dict())
            if i == 15:  # restore an older optimizer state into both
                eager_opt.load_state_dict(snapshot)
                graphed_opt.load_state_dict(copy.deepcopy(snapshot))
            eager_step(x, y)
            graphed_step(x, y)
    assert graphed_step.stats.recaptures == 1  # load_state_dict replaced the state tensors
    assert "capturing again" in caplog.text
    assert_params_close(graphed_model, eager_model, rtol=1e-5)


# ---------------------------------------------------------------- graphed autograd modules


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).cuda()


def test_gradient_accumulation_over_four_micro_batches_equals_eager() -> None:
    torch.manual_seed(0)
    eager_block, head = block(), nn.Linear(128, 8).cuda()
    graphed_head = copy.deepcopy(head)
    graphed_block = cg.graph_autograd(
        copy.deepcopy(eager_block), torch.randn(32, 128, device="cuda")
    )
    assert isinstance(graphed_block.graphed, cg.GraphedAutograd)
    for iteration in range(3):  # .grad None at the first backward, then accumulated into
        eager_block.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        graphed_block.zero_grad(set_to_none=True)
        graphed_head.zero_grad(set_to_none=True)
        batch = torch.randn(128, 128, device="cuda")
        target = torch.randn(128, 8, device="cuda")
        for micro, t in zip(batch.chunk(4), target.chunk(4)):
            (F.mse_loss(head(eager_block(micro)), t) / 4).backward()
            (F.mse_loss(graphed_head(graphed_block(micro)), t) / 4).backward()
        for p, q in zip(graphed_block.parameters(), eager_block.parameters()):
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"iteration {iteration}"
            )
        for p, q in zip(graphed_head.parameters(), head.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert graphed_block.graphed.forwards == 12 and graphed_block.graphed.backwards == 12


def test_input_gradients_pytree_inputs_and_outputs() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).cuda()

    def fn(inputs: dict, *, scale: float) -> dict:
        h = lin(inputs["x"]) * scale + inputs["bias"]
        return {"h": h, "norm": h.norm()}

    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    bias = torch.randn(64, device="cuda")
    g = cg.graph_autograd(fn, {"x": x, "bias": bias}, scale=0.5, modules=[lin])
    x2 = torch.randn(16, 64, device="cuda", requires_grad=True)
    out = g({"x": x2, "bias": bias}, scale=0.5)
    (out["h"].sum() + out["norm"]).backward()
    ref_x = x2.detach().clone().requires_grad_()
    ref_lin = copy.deepcopy(lin)
    ref_lin.zero_grad(set_to_none=True)
    h = ref_lin(ref_x) * 0.5 + bias
    (h.sum() + h.norm()).backward()
    torch.testing.assert_close(x2.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.weight.grad, ref_lin.weight.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(cg.InputMismatchError, match="scale"):
        g({"x": x2, "bias": bias}, scale=2.0)


def test_second_forward_before_backward_raises() -> None:
    g = cg.graph_autograd(block(), torch.randn(8, 128, device="cuda"))
    a = g(torch.randn(8, 128, device="cuda"))
    b = g(torch.randn(8, 128, device="cuda"))
    with pytest.raises(cg.StaleGraphError, match="overwritten"):
        (a.sum() + b.sum()).backward()


def test_chain_shares_one_pool_and_matches_eager_and_checks_order() -> None:
    torch.manual_seed(0)
    first, second = block(), nn.Sequential(nn.Linear(128, 64), nn.Tanh()).cuda()
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    x = torch.randn(32, 128, device="cuda")
    g_first, g_second = cg.graph_autograd_chain(
        [(first, (x,)), (second, (first(x).detach().requires_grad_(),))]
    )
    assert g_first.graphed.pool == g_second.graphed.pool
    for _ in range(3):
        xi = torch.randn(32, 128, device="cuda")
        out = g_second(g_first(xi))
        ref = ref_second(ref_first(xi))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        out.pow(2).mean().backward()
        ref.pow(2).mean().backward()
    for p, q in zip(
        [*first.parameters(), *second.parameters()],
        [*ref_first.parameters(), *ref_second.parameters()],
    ):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # Replaying the first stage again before the second's backward overwrote memory: refused.
    h = g_first(torch.randn(32, 128, device="cuda"))
    out = g_second(h)
    g_first(torch.randn(32, 128, device="cuda"))
    with pytest.raises(cg.StaleGraphError):
        out.sum().backward()


def test_eval_mode_is_explicit_and_the_module_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(128, 128), nn.Dropout(0.5)).cuda()
    graphed = cg.graph_autograd(model, torch.randn(16, 128, device="cuda"))
    assert "forward" not in vars(model) and graphed.original is model
    graphed.eval()
    assert not model.training  # the stand-in switches the module it stands for
    x = torch.randn(16, 128, device="cuda")
    with pytest.raises(cg.ConfigError, match="eval mode with gradients enabled"):
        graphed(x)
    with torch.no_grad():
        out = graphed(x)
        torch.testing.assert_close(out, model[1](model[0](x)), rtol=1e-5, atol=1e-6)  # no dropout
    assert graphed.graphed.eval_graph is not None
    graphed.train()
    y = graphed(x)
    assert (y == 0).float().mean().item() == pytest.approx(0.5, abs=0.05)  # dropout is back


def test_graph_autograd_captured_inside_autocast_follows_weight_updates() -> None:
    torch.manual_seed(0)
    model = block()
    reference = copy.deepcopy(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed = cg.graph_autograd(model, torch.randn(32, 128, device="cuda"))
    opt = torch.optim.SGD(graphed.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):
        x = torch.randn(32, 128, device="cuda")
        for net, o in ((graphed, opt), (reference, ref_opt)):
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = net(x)
            out.float().pow(2).mean().backward()
            o.step()
        assert torch.isfinite(out).all()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        x = torch.randn(32, 128, device="cuda")
        torch.testing.assert_close(graphed(x), reference(x), rtol=2e-2, atol=2e-2)


def scheduled(kind: str) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
    if kind == "adamw-onecycle":
        opt = cg.GraphSafeAdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1e-2, total_steps=40, cycle_momentum=True
        )
    else:
        opt = cg.GraphSafeSGD(model.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.CyclicLR(
            opt, 0.01, 0.1, step_size_up=5, cycle_momentum=True
        )
    return model, opt, schedule


@pytest.mark.parametrize("kind", ["adamw-onecycle", "sgd-cyclic"])
def test_momentum_schedules_replay_without_capturing_again(kind: str) -> None:
    """OneCycleLR cycles AdamW's betas, CyclicLR the SGD momentum: the graph-safe optimizers
    read them from device tensors refreshed before each replay, so 30 steps replay one
    capture, and the parameters follow eager's with the same optimizer implementation."""
    graphed_model, graphed_opt, graphed_schedule = scheduled(kind)
    eager_model, eager_opt, eager_schedule = scheduled(kind)
    cg.make_graph_safe(eager_opt)  # the same implementation, stepped eagerly

    def make_step(model: nn.Module, opt: Any) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        return step

    graphed = cg.train_step(make_step(graphed_model, graphed_opt), optimizer=graphed_opt)
    eager = make_step(eager_model, eager_opt)
    for _ in range(30):
        x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
        graphed(x, y)
        eager(x, y)
        graphed_schedule.step()
        eager_schedule.step()
    assert graphed.state is cg.State.CAPTURED and graphed.stats.recaptures == 0
    for a, b in zip(graphed_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _SlowStart(nn.Module):
    """A spin of a few milliseconds on the GPU, then a small MLP: a replay that is still
    running when another stream's call copies its input in."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)
        return self.net(x)


@pytest.mark.parametrize("grad", [True, False])
def test_graphed_autograd_calls_on_alternating_streams_answer_as_eager(grad: bool) -> None:
    """Calls on two streams, one after the other: the second call's copy into the static input
    must wait for the first call's replay (which reads it at its end) and the copy of its
    output, or the first answer is computed from the second input."""
    torch.manual_seed(0)
    model = _SlowStart().cuda()
    g = cg.graph_autograd(model, torch.randn(8, 64, device="cuda"))
    inputs = [torch.randn(8, 64, device="cuda") for _ in range(6)]
    with torch.no_grad():
        wants = [model.net(x) for x in inputs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = []
    with torch.set_grad_enabled(grad):
        for i, x in enumerate(inputs):
            with torch.cuda.stream(streams[i % 2]):
                outs.append(g(x).detach().clone())
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for out, want in zip(outs, wants):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
