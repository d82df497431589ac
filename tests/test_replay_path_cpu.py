"""The captured call path, exercised on the CPU with a stand-in for CUDA's graph.

CI has no GPU, but the code between a call and ``graph.replay()`` (the flat fast path, the
pytree path, copy-in, copy skipping, write-back of mutated inputs, the alias and clone policies,
guards, recapture) is plain Python over tensors. Here warm-up and capture are replaced by a
recording whose ``replay()`` reruns the function on the static inputs and copies the results
into the static outputs, which is what a CUDA graph does, so that path runs in CI too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import cudagraphs as cg
from cudagraphs.core.replay import Counters, Replayer
from cudagraphs.core.signature import Signature


def test_flat_fast_path_copies_checks_and_replays(stand_in: None) -> None:
    model = nn.Linear(4, 3).eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 4), outputs="alias")
        assert g.state is cg.State.CAPTURED
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), model(x))
        g.inputs[0].copy_(torch.ones(2, 4))
        torch.testing.assert_close(g(*g.inputs), model(torch.ones(2, 4)))
        with pytest.raises(cg.InputMismatchError, match=r"args\[0\] has shape \(3, 4\)"):
            g(torch.randn(3, 4))
        with pytest.raises(cg.InputMismatchError, match=r"args\[0\] is 'x'"):
            g("x")
    assert g.stats.replays == 4 and g.stats.copies == 3 and g.stats.copies_skipped == 1


def test_pytree_path_with_kwargs_and_frozen_values(stand_in: None) -> None:
    def fn(state: dict, *, scale: float) -> dict:
        return {"y": state["x"] * scale, "n": 1}

    g = cg.graph(fn, {"x": torch.randn(3)}, scale=2.0, outputs="clone")
    x = torch.randn(3)
    out = g({"x": x}, scale=2.0)
    torch.testing.assert_close(out["y"], x * 2)
    assert out["n"] == 1
    with pytest.raises(cg.InputMismatchError, match=r"kwargs\['scale'\] is 3.0"):
        g({"x": x}, scale=3.0)


def test_clone_policy_outputs_survive_later_calls(stand_in: None) -> None:
    g = cg.graph(lambda x: x + 1, torch.zeros(2), outputs="clone")
    a = g(torch.zeros(2))
    g(torch.ones(2))
    torch.testing.assert_close(a, torch.ones(2))


def test_mutated_inputs_are_written_back(stand_in: None) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + 1

    g = cg.graph(fn, torch.randn(3), outputs="alias")
    x = torch.randn(3)
    expected = x * 2
    torch.testing.assert_close(g(x), expected + 1)
    torch.testing.assert_close(x, expected)
    assert g.stats.writebacks == 1


def _add_one_then_read(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.add_(1)
    return b * 2


@pytest.mark.parametrize(
    "inputs",
    [lambda z: (z, z), lambda z: (z[:2], z[1:]), lambda z: (z, z.view(2, 2))],
    ids=["the same tensor twice", "overlapping views", "a view of the written input"],
)
def test_inputs_sharing_memory_with_a_written_one_are_answered_eagerly(
    stand_in: None, inputs: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """The function writes its first input in place and reads its second. Called with two
    inputs of one memory, eager's write shows through the second; a replay copies them into
    separate buffers and would not. Such a call runs eagerly (eager's answer and eager's
    write), named once in the notices; separate inputs replay as before."""
    z = torch.randn(4)
    example = inputs(torch.randn(4))
    g = cg.graph(_add_one_then_read, example[0].clone(), example[1].clone(), outputs="clone")
    expected_z = z.clone()
    expected = _add_one_then_read(*inputs(expected_z))
    got = g(*inputs(z))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(z, expected_z)  # the caller's tensor written as eager writes it
    assert g.stats.eager_calls == 1 and g.stats.replays == 0
    assert g.stats.notices == {"answered eagerly: inputs share memory": 1}
    a, b = (t.clone() for t in inputs(torch.randn(4)))  # separate tensors: replayed
    want_b = b * 2
    torch.testing.assert_close(g(a, b), want_b)
    assert g.stats.replays == 1


MODE = "double"


def by_mode(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if MODE == "double" else x * 3


def test_a_rebound_global_recaptures_or_raises(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = cg.graph(by_mode, torch.randn(3), outputs="alias")
    strict = cg.graph(by_mode, torch.randn(3), outputs="alias", on_stale="raise")
    monkeypatch.setattr(__import__(__name__), "MODE", "triple")
    x = torch.randn(3)
    torch.testing.assert_close(g(x), x * 3)
    assert g.stats.recaptures == 1
    with pytest.raises(cg.StaleGraphError, match="global 'MODE' was rebound"):
        strict(x)


def test_train_eval_switch_recaptures(stand_in: None) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(64, 4), outputs="alias")
        model.train()
        out = g(torch.randn(64, 4))
    assert g.stats.recaptures == 1
    assert (out == 0).any()


def test_buckets_fast_path_pads_slices_and_counts(stand_in: None) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(0)

    g = cg.graph(fn, torch.randn(8, 3), buckets={"B": [4, 8]}, outputs="alias")
    for n in (8, 6, 3, 7, 5):
        x = torch.randn(n, 3)
        rows, total = g(x)
        torch.testing.assert_close(rows, x * 2)
        torch.testing.assert_close(total, x.sum(0))  # the tail was padded with zeros
    assert g.stats.hits == {(8,): 4, (4,): 1}
    assert g.stats.padding_waste == pytest.approx((0 + 2 + 1 + 1 + 3) / (8 + 6 + 3 + 7 + 5))


def test_bucket_report_counts_fast_path_calls(
    stand_in: None, capsys: pytest.CaptureFixture[str]
) -> None:
    g = cg.graph(lambda x: x + 1, torch.randn(4, 2), buckets={"B": [2, 4]}, outputs="alias")
    for n in (1, 2, 3):
        g(torch.randn(n, 2))
    g.report()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith("│")]
    hits = {row.split("│")[1].strip(): row.split("│")[4].strip() for row in rows}
    assert hits == {"4": "1", "2": "2"}, out


def test_exact_shapes_capture_per_shape_and_evict(stand_in: None) -> None:
    g = cg.graph(lambda x: x * 2, torch.randn(2, 3), buckets="exact", max_graphs=2, outputs="clone")
    for n in (2, 3, 2, 4):
        x = torch.randn(n, 3)
        torch.testing.assert_close(g(x), x * 2)
    assert g.graphs == 2 and g.evictions == 1


def test_shared_pool_accounts_each_capture(stand_in: None) -> None:
    pool = cg.Pool()
    cg.graph(lambda x: x + 1, torch.randn(2), pool=pool, outputs="alias")
    cg.graph(lambda x: x - 1, torch.randn(2), pool=pool, outputs="alias")
    assert pool.captures == 2
    assert "captures=2" in repr(pool)


def test_train_step_guard_recaptures_on_optimizer_and_mode_changes(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # make_graph_safe refuses CPU parameters (it is covered on the GPU); here it records calls,
    # so that what is checked is the train step's wiring (grads set to None before each
    # capture, the optimizer and the closure's module in the guard) and, after every call,
    # the parameters against the same steps run eagerly from the same state.
    import copy

    from cudagraphs.training import step as train_module

    prepared: list[torch.optim.Optimizer] = []
    monkeypatch.setattr(
        train_module, "make_graph_safe", lambda opt, switch, notices: prepared.append(opt)
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    grads_at_capture: list[bool] = []

    def make(net: nn.Module, optimizer: torch.optim.Optimizer, log: bool):  # type: ignore[no-untyped-def]
        def step(x: torch.Tensor) -> torch.Tensor:
            if log and len(grads_at_capture) < len(prepared):  # a call that records a capture
                grads_at_capture.append(all(p.grad is None for p in net.parameters()))
            loss = net(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return step

    graphed = cg.train_step(make(model, opt, True), optimizer=opt, outputs="clone", warmup=2)
    eager = make(twin, twin_opt, False)

    def call_both() -> None:
        x = torch.randn(8, 4)
        torch.testing.assert_close(graphed(x), eager(x).detach())
        for mine, theirs in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(mine, theirs)

    call_both()  # the warm-up steps: eager; the first creates the optimizer's momentum state
    call_both()
    assert graphed.state is cg.State.WARMING_UP and not prepared
    # A stale gradient the capture must not accumulate into: a capture starts from gradients
    # set to None (what the twin's step leaves too).
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    call_both()
    assert graphed.state is cg.State.CAPTURED and grads_at_capture == [True]
    call_both()
    assert graphed.stats.recaptures == 0
    for o in (opt, twin_opt):
        o.param_groups[0]["momentum"] = 0.5  # frozen by a recording: noticed
    call_both()
    assert graphed.stats.recaptures == 1
    opt.load_state_dict(opt.state_dict())  # new state tensors: read by address
    call_both()
    assert graphed.stats.recaptures == 2
    model.eval()  # the step function's closure module: its mode is guarded too
    twin.eval()
    call_both()
    assert graphed.stats.recaptures == 3
    call_both()
    assert graphed.stats.recaptures == 3 and len(prepared) == 4
    assert grads_at_capture == [True] * 4  # every capture started from gradients set to None


def test_a_parameter_frozen_or_unfrozen_after_capture_is_trained_as_eager(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recorded step computes and applies the gradients of the parameters that required
    them at capture. Freezing one afterwards (``requires_grad_(False)``, fine-tuning's usual
    move) or unfreezing one must change what a step trains, as in eager: a new capture."""
    import copy

    from cudagraphs.training import step as train_module

    monkeypatch.setattr(train_module, "make_graph_safe", lambda opt, switch, notices: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    twin = copy.deepcopy(model)

    def make(net: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = net(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            return loss

        return step, optimizer

    step, opt = make(model)
    graphed = cg.train_step(step, optimizer=opt, outputs="clone", warmup=1)
    eager, _ = make(twin)

    def call_both() -> None:
        x = torch.randn(8, 4)
        torch.testing.assert_close(graphed(x), eager(x).detach())
        for mine, theirs in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(mine, theirs)

    for _ in range(3):
        call_both()
    for net in (model, twin):
        net[0].requires_grad_(False)
    frozen = model[0].weight.clone()
    call_both()
    assert graphed.stats.recaptures == 1
    call_both()
    torch.testing.assert_close(model[0].weight, frozen)  # not trained any more
    for net in (model, twin):
        net[0].weight.requires_grad_(True)
    call_both()
    call_both()
    assert graphed.stats.recaptures == 2
    assert any("requires_grad" in notice for notice in graphed.stats.notices)


def _sgd_step(net: nn.Module, zeroing: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """A training step whose gradients are zeroed as ``zeroing`` says: "none" (they carry
    over to the next call), "to None first", "in place first", or "two backwards, zeroed
    last" (one call's own accumulation, zeroed at the end)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        if zeroing == "to None first":
            optimizer.zero_grad(set_to_none=True)
        elif zeroing == "in place first":
            optimizer.zero_grad(set_to_none=False)
        loss = net(x).pow(2).mean()
        loss.backward()
        if zeroing == "two backwards, zeroed last":
            net(x).abs().mean().backward()  # adds to this call's first backward: the step's own
        optimizer.step()
        if zeroing == "two backwards, zeroed last":
            optimizer.zero_grad(set_to_none=True)
        return loss

    return step, optimizer


@pytest.mark.parametrize("warmup", [1, 2])
@pytest.mark.parametrize(
    "zeroing", ["to None first", "in place first", "two backwards, zeroed last", "none"]
)
def test_a_step_that_carries_gradients_to_the_next_call_is_refused_not_replayed(
    stand_in: None, monkeypatch: pytest.MonkeyPatch, zeroing: str, warmup: int
) -> None:
    """A step that never zeroes its gradients adds, in eager, to what the last call left; a
    recorded step starts from gradients set to None and writes them afresh, so every replay
    would silently drop the carried part. The last warm-up step watches for it and the capture
    is refused, naming the parameters. With one warm-up step, which begins with no gradients
    and so cannot show it, one more eager step runs first. Steps that zero (either way) or
    accumulate within one call replay as eager, step for step."""
    import copy

    from cudagraphs.training import step as train_module

    monkeypatch.setattr(train_module, "make_graph_safe", lambda opt, switch, notices: None)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    step, opt = _sgd_step(model, zeroing)
    graphed = cg.train_step(step, optimizer=opt, outputs="clone", warmup=warmup)
    eager, _ = _sgd_step(twin, zeroing)

    def call_both() -> None:
        x = torch.randn(8, 4)
        torch.testing.assert_close(graphed(x), eager(x).detach())
        for mine, theirs in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(mine, theirs)

    call_both()
    call_both()  # the last warm-up step: watched
    if zeroing == "none":
        before = [p.clone() for p in model.parameters()]
        with pytest.raises(cg.FrozenStateError, match=r"Linear\.weight.*accumulates across"):
            graphed(torch.randn(8, 4))
        for p, was in zip(model.parameters(), before):
            torch.testing.assert_close(p, was)  # refused before any step ran
        return
    for _ in range(4):
        call_both()
    assert graphed.stats.replays >= 3


def test_keywords_and_a_mode_switch_take_the_general_path(stand_in: None) -> None:
    # A keyword call and a module switched to training mode under the guard take the general
    # path (which explains the keyword, and recaptures after the switch).
    import gc
    import inspect
    import weakref

    model = nn.Linear(4, 3).eval()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with torch.no_grad():
        g = cg.graph(fn, torch.randn(2, 4), outputs="alias", modules=[model])
        x = torch.randn(2, 4)
        with pytest.raises(cg.InputMismatchError, match=r"unexpected kwargs\['x'\]"):
            g(x=x)
        model.train()
        torch.testing.assert_close(g(x), model(x))
        assert g.stats.recaptures == 1
        with pytest.raises(cg.InputMismatchError):
            g(x, x)
    assert list(inspect.signature(g).parameters) == ["x"] and callable(g)
    gc.disable()
    try:  # nothing refers back to the graph: dropping it frees it at once
        alive = weakref.ref(g)
        del g
        assert alive() is None
    finally:
        gc.enable()


# The order of a replay's steps, on both ways into the one replay path, with a stand-in graph:
# the previous outputs are marked dead after the launch, also when it fails.
def stand_in_replayer(steps: list[str], failing: list[bool]) -> tuple[Replayer, torch.Tensor]:
    def replay() -> None:
        steps.append("replay")
        if failing:
            raise RuntimeError("launch failed")

    x = torch.randn(3)
    signature, leaves = Signature.of_call((x,), {})
    graph: Any = SimpleNamespace(replay=replay)
    replayer = Replayer(graph, signature, leaves, [], x * 2, "alias", Counters())
    replayer.invalidate = lambda: steps.append("invalidate")
    replayer.emit = lambda: steps.append("emit") or "out"
    return replayer, x


def general(replayer: Replayer, x: torch.Tensor) -> Any:
    return replayer.call([x], (x,), {})


def static(replayer: Replayer, x: torch.Tensor) -> Any:
    return replayer.replay_static()


@pytest.mark.parametrize("path", [general, static], ids=lambda f: f.__name__)
def test_the_previous_outputs_are_marked_dead_after_the_launch(
    path: Callable[[Replayer, torch.Tensor], Any],
) -> None:
    steps: list[str] = []
    failing: list[bool] = []
    replayer, x = stand_in_replayer(steps, failing)
    assert path(replayer, x) == "out"
    assert steps == ["replay", "invalidate", "emit"]
    steps.clear()
    failing.append(True)
    with pytest.raises(RuntimeError, match="launch failed"):
        path(replayer, x)
    assert steps == ["replay", "invalidate"]  # a failed launch may have overwritten them


def test_a_copy_node_takes_only_tensors_whose_bytes_are_their_values() -> None:
    """The check the call makes before pointing a copy node at a tensor (the nodes themselves
    need a GPU; the check is plain tensor metadata)."""
    from cudagraphs.core.launch import CopyNodes

    buf = torch.zeros(4, 8)
    nodes = CopyNodes.__new__(CopyNodes)  # the check reads only the buffer's address and size
    nodes._dst, nodes._nbytes = [buf.data_ptr()], [buf.nbytes]
    z = torch.randn(8, 4, dtype=torch.complex64)
    big = torch.zeros(10, 8)
    taken = {
        "plain": torch.randn(4, 8),
        "transposed": torch.randn(8, 4).t(),
        "negative bit": z.conj().imag.t(),
        "requires grad": torch.randn(4, 8, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.randn(4, 8)),
        "the buffer": buf,
    }
    got = {name: nodes.takes(0, x, x.data_ptr()) for name, x in taken.items()}
    assert got == {"plain": True, "transposed": False, "negative bit": False,
                   "requires grad": False, "parameter": False, "the buffer": False}  # fmt: skip
    nodes._dst, nodes._nbytes = [big.data_ptr()], [big[:4].nbytes]  # overlapping, and not
    assert not nodes.takes(0, big[1:5], big[1:5].data_ptr())
    assert nodes.takes(0, big[4:8], big[4:8].data_ptr())


def test_a_momentum_schedule_warns_once_in_thirty_steps_and_counts_every_recapture(
    stand_in: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch's AdamW under OneCycleLR(cycle_momentum=True): betas[0] changes every step, each
    change a recapture; one warning is printed in 30 steps, and stats.notices counts them all
    (the steps' results are compared with eager's by the GPU tests: the stand-in is no graph)."""
    import warnings

    from cudagraphs.training import optimizers
    from cudagraphs.training import step as train_module

    # make_graph_safe refuses CPU parameters; on the CPU only its warning is kept.
    monkeypatch.setattr(
        train_module,
        "make_graph_safe",
        lambda opt, switch, notices: optimizers.warn_momentum_schedule(opt, notices),
    )
    torch.manual_seed(0)
    model = nn.Linear(8, 4)

    def make(net: nn.Module) -> tuple[torch.optim.Optimizer, object]:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=2e-2, total_steps=40, cycle_momentum=True
        )

    def make_step(net: nn.Module, opt: torch.optim.Optimizer):
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        return step

    opt, sched = make(model)
    # On a CUDA build of torch without a GPU, AdamW's check for a capture in progress asks the
    # (stand-in's) CUDA for its stream; there is none to ask.
    for check in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):
        if hasattr(opt, check):
            monkeypatch.setattr(opt, check, lambda: None)
    graphed = cg.train_step(make_step(model, opt), optimizer=opt, warmup=1, outputs="clone")
    caplog.set_level(logging.INFO, logger="cudagraphs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):
            x, y = torch.randn(16, 8), torch.randn(16, 4)
            graphed(x, y)
            sched.step()
    printed = [r for r in caplog.records if r.levelno >= logging.WARNING] + list(caught)
    assert len(printed) == 1, [str(getattr(p, "message", p)) for p in printed]
    assert "cycles AdamW's momentum" in caplog.records[0].getMessage()
    counted = graphed.stats.notices["capturing again: AdamW.param_groups[0]['betas']"]
    assert graphed.stats.recaptures >= 25 and counted == graphed.stats.recaptures


@pytest.mark.parametrize("move", ["param.data", "module.to", "buffer rebound"])
def test_a_tensor_moved_after_capture_captures_again_or_raises(stand_in: None, move: str) -> None:
    """A parameter or buffer pointed at new memory after the capture: the graph would read the
    old memory, so the guard captures again (or raises under on_stale="raise")."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).requires_grad_(False)
    model.register_buffer("offset", torch.zeros(4))
    forward = model.forward
    model.forward = lambda x: forward(x) + model.offset  # type: ignore[method-assign]
    x = torch.randn(2, 4)
    g = cg.graph(model, x, outputs="clone")
    strict = cg.graph(model, x, outputs="clone", on_stale="raise")
    g(x)
    if move == "param.data":
        model.weight.data = torch.randn(4, 4)
    elif move == "module.to":
        model.to(torch.float64).to(torch.float32)
    else:
        model.offset = torch.ones(4)
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1
    with pytest.raises(cg.StaleGraphError):
        strict(x)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: torch.randn(2, 4, dtype=torch.float64), id="float64"),
        pytest.param(lambda: torch.randn(1, 4), id="broadcastable (1, 4)"),
        pytest.param(lambda: torch.randn(4), id="broadcastable (4,)"),
    ],
)
def test_an_input_a_copy_would_convert_or_broadcast_is_refused_on_the_fast_path(
    stand_in: None, bad: Callable[[], torch.Tensor]
) -> None:
    """copy_ into the (2, 4) float32 buffer would silently convert a float64 input, or
    broadcast a (1, 4) or (4,) one over both rows: the fast path refuses it by name."""
    model = nn.Linear(4, 4).requires_grad_(False)
    g = cg.graph(model, torch.randn(2, 4), outputs="clone")
    g(torch.randn(2, 4))
    with pytest.raises(cg.InputMismatchError, match=r"args\[0\]"):
        g(bad())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_bucketed_graph_refuses_another_dtype(stand_in: None, dtype: torch.dtype) -> None:
    model = nn.Linear(4, 4).requires_grad_(False)
    g = cg.graph(model, torch.randn(4, 4), buckets={"B": [2, 4]}, outputs="clone")
    torch.testing.assert_close(g(torch.randn(3, 4)).shape, torch.Size([3, 4]))
    with pytest.raises(cg.InputMismatchError):
        g(torch.randn(3, 4, dtype=dtype))


def _add_forward_hook(model: nn.Sequential) -> Any:
    return model[0].register_forward_hook(lambda module, args, out: out * 3)


def _add_forward_pre_hook(model: nn.Sequential) -> Any:
    return model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))


def _add_prepended_hook(model: nn.Sequential) -> Any:
    return model[2].register_forward_hook(lambda module, args, out: out - 1, prepend=True)


def _add_global_hook(model: nn.Sequential) -> Any:
    from torch.nn.modules.module import register_module_forward_hook

    return register_module_forward_hook(
        lambda module, args, out: out + 1 if isinstance(module, nn.Linear) else out
    )


HOOKS = {
    "forward hook on a child": _add_forward_hook,
    "forward pre-hook on the model": _add_forward_pre_hook,
    "hook prepended to a child's": _add_prepended_hook,
    "global module forward hook": _add_global_hook,
}


@pytest.mark.parametrize("add", list(HOOKS.values()), ids=list(HOOKS))
def test_a_hook_added_or_removed_after_capture_gives_eager_s_answer(
    stand_in: None, add: Callable[[nn.Sequential], Any]
) -> None:
    """Hooks run in Python around a module's forward: the recording holds what they did at
    capture. One registered after it (or removed) must capture again, never replay the old
    answer; under on_stale="raise" it raises, naming the hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).requires_grad_(False)
    existing = model[2].register_forward_hook(lambda module, args, out: out * 0.5)
    x = torch.randn(2, 4)
    g = cg.graph(model, x, outputs="clone")
    strict = cg.graph(model, x, outputs="clone", on_stale="raise")
    torch.testing.assert_close(g(x), model(x))
    recorded = model(x)
    handle = add(model)
    try:
        assert not torch.allclose(model(x), recorded)  # the hook matters to the answer
        torch.testing.assert_close(g(x), model(x))
        assert g.stats.recaptures == 1
        with pytest.raises(cg.StaleGraphError, match="hook"):
            strict(x)
    finally:
        handle.remove()
    torch.testing.assert_close(g(x), recorded)  # removed again: captured again without it
    assert g.stats.recaptures == 2
    existing.remove()
    torch.testing.assert_close(g(x), model(x))  # a hook present at capture, removed since
    assert g.stats.recaptures == 3


class _Scaled(nn.Module):
    """Its forward reads its own mode, as dropout and batch norm do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (2.0 if self.training else 1.0)


def _switch_child_mode(model: nn.Sequential) -> None:
    model[1].train()  # one child only, as freezing batch norm layers does


def _swap_child_class(model: nn.Sequential) -> None:
    model[0].__class__ = type("Shifted", (nn.Linear,), {"forward": lambda s, x: x + 1.0})


@pytest.mark.parametrize(
    "change", [_switch_child_mode, _swap_child_class], ids=["child's mode", "child's class"]
)
def test_a_child_module_s_mode_or_class_changed_after_capture_gives_eager_s_answer(
    stand_in: None, change: Callable[[nn.Sequential], None]
) -> None:
    """The guard holds every module of the tree, not only the root: a child switched to train
    mode alone (its forward reads ``self.training``) or given another class must capture again."""
    torch.manual_seed(0)
    _answers_as_eager_after(nn.Sequential(nn.Linear(4, 4), _Scaled()).eval(), change)


def _answers_as_eager_after(model: nn.Sequential, change: Callable[[nn.Sequential], None]) -> None:
    """Capture ``model``, make the change, and check the next call answers as eager through
    one new capture."""
    model.requires_grad_(False)
    x = torch.randn(2, 4)
    g = cg.graph(model, x, outputs="clone")
    recorded = g(x)
    change(model)
    assert not torch.allclose(model(x), recorded)  # the change matters to the answer
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


TORCH_SETTINGS = {
    "LeakyReLU.negative_slope": lambda m: setattr(m[1], "negative_slope", 0.9),
    "LayerNorm.eps": lambda m: setattr(m[2], "eps", 10.0),
    "GELU.approximate": lambda m: setattr(m[3], "approximate", "tanh"),
    "Softmax.dim": lambda m: setattr(m[4], "dim", 0),
}


@pytest.mark.parametrize("change", list(TORCH_SETTINGS.values()), ids=list(TORCH_SETTINGS))
def test_a_setting_of_a_torch_module_changed_after_capture_gives_eager_s_answer(
    stand_in: None, change: Callable[[nn.Sequential], None]
) -> None:
    """Settings torch's own modules read in their forward (a slope, an epsilon, a dimension)
    are plain values read by torch's code, which the value watch does not follow: the guard
    holds the ones each module's class code loads, and a change captures again."""
    torch.manual_seed(0)
    layers = (nn.Linear(4, 4), nn.LeakyReLU(0.1), nn.LayerNorm(4), nn.GELU(), nn.Softmax(dim=-1))
    _answers_as_eager_after(nn.Sequential(*layers), change)
