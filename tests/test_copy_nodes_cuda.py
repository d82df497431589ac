"""The inputs' copy-in recorded in the graph (core/launch.py) on a real GPU: every kind of
input still gives eager's answer, and nothing but a call points a node anywhere."""

from __future__ import annotations

import gc

import pytest
import torch

import cudagraphs as cg
from cudagraphs.core import launch
from cudagraphs.tools.segment_workloads import DecisionMLP

pytestmark = pytest.mark.cuda
TOL = dict(rtol=1e-5, atol=1e-5)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)]
    return torch.nn.Sequential(*layers).cuda().eval()


@torch.no_grad()
def test_a_graph_copies_its_inputs_in_itself() -> None:
    net = model()
    g = cg.graph(net, rand(4, 8))
    copies = g.replayer.copies
    assert copies is not None and copies.state == [0]  # recorded, and off until a call
    x = rand(4, 8)
    torch.testing.assert_close(g(x).clone(), net(x), **TOL)
    assert copies.state == [x.data_ptr()] and g.stats.copies == 1
    torch.testing.assert_close(g(g.inputs[0]).clone(), net(g.inputs[0]), **TOL)
    assert copies.state == [0]  # the buffer itself: nothing to copy
    # On the GPU machine the edits are one C call each, and none of them fell back.
    assert launch.native_edits() and copies._edits.native is not None


@torch.no_grad()
def test_every_kind_of_input_gives_eagers_answer() -> None:
    net = model()

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return net(a) * b + c

    g = cg.graph(f, rand(4, 8), rand(4, 8), rand(4, 8))
    assert g.replayer.copies is not None and len(g.replayer.copies.nodes) == 3
    z = torch.randn(8, 4, dtype=torch.complex64, device="cuda")
    kept = rand(4, 8)
    calls = [
        (rand(4, 8), rand(4, 8), rand(4, 8)),
        (rand(8, 4).t(), z.conj().imag.t(), rand(4, 8)),  # strided, and a lazily negated view
        (g.inputs[0], rand(4, 8), g.inputs[2]),  # static buffers themselves
        (kept, kept, kept),  # one tensor three times
        (kept, kept, kept),  # the same again: no node is edited
        (rand(4, 8).requires_grad_(), rand(4, 8), rand(4, 8)),  # under no_grad: allowed
    ]
    for a, b, c in calls:
        expected = f(a.clone(), b.clone(), c.clone())
        torch.testing.assert_close(g(a, b, c).clone(), expected, **TOL)
    assert g.stats.replays == len(calls)


@torch.no_grad()
def test_a_freed_input_is_never_read_again() -> None:
    net = model()
    g = cg.graph(net, rand(4, 8))
    x = rand(4, 8)
    g(x)
    del x
    gc.collect()
    torch.cuda.empty_cache()
    garbage = [torch.full((4, 8), 1e6, device="cuda") for _ in range(8)]  # reuse the memory
    # The recording as the user sees it replays on its buffers, whatever a call pointed at.
    g.inputs[0].copy_(rand(4, 8))
    g.graph.replay()
    expected = net(g.inputs[0])
    torch.testing.assert_close(g.replayer.output.clone(), expected, **TOL)
    y = rand(4, 8)
    torch.testing.assert_close(g(y).clone(), net(y), **TOL)
    del garbage


@torch.no_grad()
def test_segments_copy_their_inputs_in_the_first_graph() -> None:
    torch.manual_seed(0)
    net = DecisionMLP(width=64, layers=6).cuda().eval()
    with pytest.warns(cg.CudaGraphsWarning, match="eager step"):
        g = cg.graph(net, rand(8, 64))
    assert g.replayer.copies is not None and len(g.segments) == 3
    for threshold in (-1e9, 1e9, 0.0):
        net.threshold.fill_(threshold)
        for _ in range(3):
            x = rand(8, 64)
            torch.testing.assert_close(g(x).clone(), net(x.clone()), **TOL)


@torch.no_grad()
def test_without_cuda_bindings_inputs_are_copied_before_the_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launch, "cuda_runtime", lambda: None)
    net = model()
    g = cg.graph(net, rand(4, 8))
    assert g.replayer.copies is None
    for _ in range(3):
        x = rand(4, 8)
        torch.testing.assert_close(g(x).clone(), net(x), **TOL)
