"""The graphed callable on a real GPU: correctness against eager, policies, errors, recovery."""

from __future__ import annotations

import collections
import dataclasses
import logging

import pytest
import torch

import cudagraphs as cg
from cudagraphs.tools.workloads import MODELS

pytestmark = pytest.mark.cuda

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize("policy", ["alias", "guarded", "clone"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_match_eager_on_fresh_inputs(name: str, policy: str) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, rand(*shape), outputs=policy)
        assert g.state is cg.State.CAPTURED
        for _ in range(5):
            x = rand(*shape)
            torch.testing.assert_close(g(x).clone(), model(x), **TOL[torch.float32])
    stats = g.stats
    assert stats.replays == 5 and stats.copies == 5 and stats.pool_bytes > 0


def test_examples_are_not_modified_and_first_call_is_correct() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + 1

    example = rand(16)
    before = example.clone()
    g = cg.graph(fn, example, warmup=3)
    torch.testing.assert_close(example, before)  # warm-up ran on the graph's own buffers
    x = rand(16)
    expected_x = x * 2
    out = g(x)
    torch.testing.assert_close(out, expected_x + 1)
    torch.testing.assert_close(x, expected_x)  # the in-place mutation was written back
    assert g.stats.writebacks == 1


def test_mutation_through_static_buffer_needs_no_writeback() -> None:
    g = cg.graph(lambda x: x.add_(1), rand(8))
    buf = g.inputs[0]
    buf.copy_(torch.arange(8.0, device="cuda"))
    g(buf)
    torch.testing.assert_close(buf, torch.arange(8.0, device="cuda") + 1)
    assert g.stats.writebacks == 0 and g.stats.copies_skipped == 1


def test_guarded_raises_on_stale_read_including_views() -> None:
    g = cg.graph(lambda x: x * 2, rand(4), outputs="guarded")
    a = g(torch.ones(4, device="cuda"))
    view = a[1:]
    torch.testing.assert_close(a, torch.full((4,), 2.0, device="cuda"))
    b = g(torch.full((4,), 3.0, device="cuda"))
    torch.testing.assert_close(b, torch.full((4,), 6.0, device="cuda"))
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        a.sum()
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        print(view)
    # Passing a stale output back in is refused by the library itself, as StaleOutputError.
    g(b)  # the latest output is fine as an input
    with pytest.raises(cg.StaleOutputError, match=r"args\[0\]"):
        g(b)


def test_guarded_keeps_aliasing_between_outputs() -> None:
    g = cg.graph(lambda x: (x * 2, x), rand(4))
    y, same = g(torch.ones(4, device="cuda"))
    torch.testing.assert_close(y, torch.full((4,), 2.0, device="cuda"))
    torch.testing.assert_close(same, torch.ones(4, device="cuda"))


def test_alias_is_overwritten_and_clone_is_not() -> None:
    alias = cg.graph(lambda x: x + 1, rand(3), outputs="alias")
    a = alias(torch.zeros(3, device="cuda"))
    alias(torch.ones(3, device="cuda"))
    # The documented hazard of outputs="alias": the first result now holds the second's values.
    torch.testing.assert_close(a, torch.full((3,), 2.0, device="cuda"))
    clone = cg.graph(lambda x: x + 1, rand(3), outputs="clone")
    c1 = clone(torch.zeros(3, device="cuda"))
    c2 = clone(torch.ones(3, device="cuda"))
    torch.testing.assert_close(c1, torch.ones(3, device="cuda"))
    torch.testing.assert_close(c2, torch.full((3,), 2.0, device="cuda"))


def test_passing_static_inputs_skips_the_copy() -> None:
    model = MODELS["mlp_256"][0]().cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, rand(128, 256))
        x = rand(128, 256)
        g.inputs[0].copy_(x)
        torch.testing.assert_close(g(*g.inputs), model(x))
    assert g.stats.copies == 0 and g.stats.copies_skipped == 1


@pytest.mark.parametrize(
    "args, error",
    [
        ((torch.zeros(64, 256),), r"args\[0\] has shape \(64, 256\)"),
        ((torch.zeros(128, 256, dtype=torch.float16),), r"args\[0\] has dtype torch.float16"),
        ((torch.zeros(128, 256, device="cpu"),), r"args\[0\] has device cpu"),
        ((torch.zeros(256),), r"args\[0\] has shape"),
        ((3,), r"args\[0\] is 3"),
        ((torch.zeros(128, 256), torch.zeros(1)), "unexpected args"),
    ],
)
def test_bad_inputs_raise_named_errors(args: tuple, error: str) -> None:
    model = MODELS["mlp_256"][0]().cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, rand(128, 256))
        args = tuple(
            a.cuda() if isinstance(a, torch.Tensor) and "cpu" not in error else a for a in args
        )
        with pytest.raises(cg.InputMismatchError, match=error):
            g(*args)
        # The graph is unharmed by a refused call.
        x = rand(128, 256)
        torch.testing.assert_close(g(x), model(x))


class Obs(collections.namedtuple("Obs", "pos vel")):
    pass


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    scale: float


def test_pytrees_args_kwargs_namedtuples_dataclasses() -> None:
    def fn(state: dict, obs: Obs, batch: Batch, *, temperature: float = 1.0) -> dict:
        return {
            "a": [state["h"] * obs.pos, obs.vel.sum(-1)],
            "b": (batch.tokens * batch.scale / temperature, "label"),
        }

    def inputs() -> tuple[tuple, dict]:
        return (
            {"h": rand(4, 3)},
            Obs(rand(4, 3), rand(4, 3)),
            Batch(rand(5), 2.0),
        ), {"temperature": 0.5}

    args, kwargs = inputs()
    g = cg.graph(fn, *args, **kwargs)
    for _ in range(3):
        args, kwargs = inputs()
        got, expected = g(*args, **kwargs), fn(*args, **kwargs)
        assert got["b"][1] == "label"
        torch.testing.assert_close(got["a"], expected["a"])
        torch.testing.assert_close(got["b"][0], expected["b"][0])
    with pytest.raises(cg.InputMismatchError, match=r"kwargs\['temperature'\] is 0.7"):
        g(*args, temperature=0.7)
    with pytest.raises(cg.InputMismatchError, match=r"args\[2\]\.scale is 3.0"):
        g(args[0], args[1], Batch(rand(5), 3.0), temperature=0.5)
    with pytest.raises(cg.InputMismatchError, match=r"args\[0\]\['h'\] has shape"):
        g({"h": rand(2, 3)}, args[1], args[2], temperature=0.5)


@pytest.mark.parametrize(
    "body, kind",
    [
        ("item", "host-sync"),
        ("sync", "host-sync"),
        ("cpu_tensor", "cpu-tensor"),
        ("nonzero", "host-sync"),
    ],
)
def test_failed_capture_raises_plain_error_and_process_stays_usable(body: str, kind: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if body == "item":
            return x * x.sum().item()
        if body == "sync":
            y = x * 2
            torch.cuda.synchronize()
            return y
        if body == "cpu_tensor":
            return x + torch.tensor([1.0, 2.0, 3.0, 4.0]).to(x.device)
        return x[x.nonzero()[:, 0]]

    with pytest.raises(cg.CaptureError) as info:
        cg.graph(fn, rand(4))
    error = info.value
    assert error.kind == kind, str(error)
    assert error.__cause__ is not None
    assert "test_graph_cuda.py" in (error.location or ""), error.location
    assert "fix:" in str(error)
    # The doctor ran on the eager path and names the line too.
    assert error.findings and "cg.doctor found" in str(error)
    assert any(f.filename.endswith("test_graph_cuda.py") for f in error.findings)
    # The process is usable: eager work and a new capture both succeed.
    x = rand(4)
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)
    g = cg.graph(lambda t: t * 3, rand(4))
    torch.testing.assert_close(g(x), x * 3)


def test_fallback_eager_logs_once_and_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * x.max().item()

    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        g = cg.graph(fn, rand(4), fallback="eager")
        x = rand(4)
        torch.testing.assert_close(g(x), fn(x))
        g(x)
    assert g.state is cg.State.EAGER
    assert g.fallback_reason is not None and "host-sync" in g.fallback_reason
    records = [r for r in caplog.records if r.name == "cudagraphs"]
    assert len(records) == 1 and "eagerly" in records[0].getMessage()
    assert g.stats.eager_calls == 2 and g.stats.replays == 0


def test_torch_compiled_callable_captures_and_matches() -> None:
    model = MODELS["mlp_256"][0]().cuda().eval()
    compiled = torch.compile(model)
    with torch.no_grad():
        g = cg.graph(compiled, rand(128, 256), warmup=3)
        for _ in range(3):
            x = rand(128, 256)
            torch.testing.assert_close(g(x), model(x), rtol=1e-4, atol=1e-4)


def test_decorators_run_warmup_calls_eagerly_then_capture() -> None:
    @cg.graph
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @cg.graph(warmup=5, outputs="clone")
    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    assert double.state is cg.State.LAZY
    x = rand(5)
    # The first `warmup` calls are the caller's real calls, answered eagerly; the next captures
    # and is answered by its own replay: N calls, N executions.
    for _ in range(3):
        torch.testing.assert_close(double(x), x * 2)
    assert double.state is cg.State.WARMING_UP and double.stats.eager_calls == 3
    torch.testing.assert_close(double(x), x * 2)
    assert double.state is cg.State.CAPTURED and double.stats.replays == 1
    for _ in range(6):
        torch.testing.assert_close(triple(x), x * 3)
    assert triple.stats.eager_calls == 5 and triple.stats.replays == 1


def test_decorated_method_gets_one_graph_per_instance() -> None:
    class Scaler:
        def __init__(self, k: float) -> None:
            self.k = k

        @cg.graph
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

    two, three = Scaler(2.0), Scaler(3.0)
    x = rand(4)
    torch.testing.assert_close(two(x), x * 2)
    torch.testing.assert_close(three(x), x * 3)
    torch.testing.assert_close(two(x), x * 2)


def test_bound_method_and_shared_pool() -> None:
    model = MODELS["mlp_256"][0]().cuda().eval()
    with torch.no_grad():
        first = cg.graph(model.forward, rand(128, 256))
        second = cg.graph(model, rand(64, 256), pool=first)
        assert second.pool == first.pool
        for _ in range(3):
            x, y = rand(128, 256), rand(64, 256)
            a = first(x).clone()
            b = second(y).clone()
            torch.testing.assert_close(a, model(x))
            torch.testing.assert_close(b, model(y))


def test_dropout_draws_new_masks_on_every_replay() -> None:
    drop = torch.nn.Dropout(p=0.5).cuda().train()
    g = cg.graph(drop, torch.ones(4096, device="cuda"), outputs="clone")
    ones = torch.ones(4096, device="cuda")
    masks = [g(ones) != 0 for _ in range(3)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    keep = torch.stack(masks).float().mean().item()
    assert 0.45 < keep < 0.55


def test_a_capture_whose_outputs_need_gradients_is_refused() -> None:
    model = torch.nn.Linear(4, 4).cuda()
    with pytest.raises(cg.GradientsNotRecordedError, match=r"cg\.graph_autograd"):
        cg.graph(model, rand(2, 4))  # eager's output has a gradient path; a replay's never
    with torch.no_grad():
        g = cg.graph(model, rand(2, 4))
        x = rand(2, 4)
        torch.testing.assert_close(g(x), model(x))


def test_inference_mode_capture_and_mutation_detection() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    with torch.inference_mode():
        g = cg.graph(fn, rand(4))
        x = rand(4)
        expected = (x + 1) * 2
        torch.testing.assert_close(g(x), expected)
        torch.testing.assert_close(x, expected / 2)


def test_frozen_python_constant_is_checked() -> None:
    g = cg.graph(lambda x, scale: x * scale, rand(3), 2.0)
    x = rand(3)
    torch.testing.assert_close(g(x, 2.0), x * 2)
    with pytest.raises(cg.InputMismatchError, match=r"args\[1\] is 3.0"):
        g(x, 3.0)


def test_replay_survives_cublas_workspace_clearing_and_empty_cache() -> None:
    # Regression: reduce-overhead clears cuBLAS workspaces on every recording. A graph whose
    # workspace lived outside its pool then replayed into freed memory (illegal memory access).
    model = MODELS["mlp_256"][0]().cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, rand(128, 256))
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        junk = [torch.randn(1 << 20, device="cuda") for _ in range(8)]  # reuse freed memory
        for _ in range(3):
            x = rand(128, 256)
            torch.testing.assert_close(g(x), model(x))
        del junk


def test_graph_coexists_with_reduce_overhead() -> None:
    model = MODELS["mlp_256"][0]().cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        g = cg.graph(model, rand(128, 256))
        for _ in range(4):
            x = rand(128, 256)
            expected = model(x)
            torch.testing.assert_close(compiled(x).clone(), expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(g(x), expected)


def test_capture_inside_an_autocast_region_records_the_casts() -> None:
    # With autocast's cast cache on, warm-up would cache bf16 weights and the recording would
    # read them instead of casting: a later weight update would be silently ignored.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    ).cuda()
    x = rand(16, 64)
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            g = cg.graph(model, x)
            model[0].weight.mul_(2)  # in place: the graph must see it
            out = g(x).clone()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            expected = model(x)  # a fresh region casts the updated weights
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])
