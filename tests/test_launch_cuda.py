"""Graph launches in one C call (core/launch.py) on a real GPU: eager's answer for every input,
random numbers fresh at every replay (those graphs keep ``CUDAGraph.replay()``), calls from
other streams and threads, and segments."""

from __future__ import annotations

import itertools
import threading
from typing import Any

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
    layers = [torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)]
    return torch.nn.Sequential(*layers).cuda().eval()


def first_launcher(g: Any) -> launch.Launcher:
    return g.replayer.launchers[0]


@torch.no_grad()
def test_after_two_launches_a_graph_without_random_numbers_is_launched_directly() -> None:
    net = model()
    g = cg.graph(net, rand(8, 64))
    launcher = first_launcher(g)
    assert launch.direct_launches()  # the compiled module and both libraries were found
    for i in range(4):
        x = rand(8, 64)
        torch.testing.assert_close(g(x).clone(), net(x), **TOL)
        assert launcher.direct is (i >= 1)  # two launches through replay() watched first


@torch.no_grad()
def test_a_graph_that_draws_random_numbers_keeps_replay_and_fresh_numbers() -> None:
    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x)

    g = cg.graph(noisy, rand(4, 64))
    x = rand(4, 64)
    outs = [g(x).clone() for _ in range(5)]
    assert not first_launcher(g).direct
    for a, b in itertools.pairwise(outs):
        assert not torch.equal(a, b)  # each replay draws anew
    noise = torch.stack(outs) - x
    assert abs(noise.mean().item()) < 0.1 and abs(noise.std().item() - 1) < 0.1


@torch.no_grad()
def test_inputs_in_turn_the_buffer_itself_and_a_replay_on_the_buffers_are_exact() -> None:
    net = model()
    g = cg.graph(net, rand(8, 64))
    inputs = [rand(8, 64) for _ in range(12)]
    wants = [net(x) for x in inputs]
    for _ in range(3):
        for x, want in zip(inputs, wants):
            torch.testing.assert_close(g(x).clone(), want, **TOL)
    assert first_launcher(g).direct
    # The static buffer itself, and g.graph.replay(): every copy node off, on the buffers.
    torch.testing.assert_close(g(g.inputs[0]).clone(), net(g.inputs[0]), **TOL)
    g.inputs[0].copy_(inputs[3])
    g.graph.replay()
    torch.testing.assert_close(g.replayer.output.clone(), wants[3], **TOL)
    assert g.replayer.copies is not None and g.replayer.copies.state == [0]
    for x, want in zip(inputs[:4], wants[:4]):
        torch.testing.assert_close(g(x).clone(), want, **TOL)


@torch.no_grad()
def test_calls_from_another_stream_are_exact() -> None:
    net = model()
    g = cg.graph(net, rand(8, 64))
    inputs = [rand(8, 64) for _ in range(3)]
    wants = [net(x) for x in inputs]
    for x in inputs * 2:
        g(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [g(x).clone() for x in inputs]
    torch.cuda.current_stream().wait_stream(side)
    for out, want in zip(outs, wants):
        torch.testing.assert_close(out, want, **TOL)
    for x, want in zip(inputs, wants):
        torch.testing.assert_close(g(x).clone(), want, **TOL)


@torch.no_grad()
def test_threads_with_streams_of_their_own_get_eagers_answer() -> None:
    net = model()
    g = cg.graph(net, rand(8, 64))
    for _ in range(3):
        g(rand(8, 64))
    inputs = [rand(8, 64) for _ in range(16)]
    wants = [net(x) for x in inputs]
    torch.cuda.synchronize()
    wrong: list[int] = []
    done: list[int] = []  # calls each thread finished: a thread that raised counts none

    def worker(k: int) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        stream = torch.cuda.Stream()
        calls = 0
        with torch.cuda.stream(stream):
            for _ in range(25):
                for i in range(k, len(inputs), 4):
                    if not torch.allclose(g(inputs[i]).clone(), wants[i], **TOL):
                        wrong.append(i)
                    calls += 1
        done.append(calls)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert wrong == []
    assert done == [100] * 4


@torch.no_grad()
def test_segments_launch_every_graph_directly_and_stay_exact() -> None:
    torch.manual_seed(0)
    net = DecisionMLP(width=64, layers=6).cuda().eval()
    inputs = [rand(8, 64) for _ in range(10)]
    g = cg.graph(net, inputs[0])
    recording = g.replayer.recording
    for threshold in (-1e9, 1e9, 0.0):
        net.threshold.fill_(threshold)
        for x in inputs * 2:
            torch.testing.assert_close(g(x).clone(), net(x), **TOL)
    assert all(recording.launcher(graph).direct for graph in recording.graphs)


@torch.no_grad()
def test_a_call_on_another_stream_waits_for_the_last_callers_stream() -> None:
    """The last caller's stream still reads the output (a long kernel, then a copy of it) when
    a call on another stream replays: that replay must wait, or it overwrites the output first."""
    net = model()
    g = cg.graph(net, rand(8, 64))
    inputs = [rand(8, 64) for _ in range(6)]
    wants = [net(x) for x in inputs]
    for copy, want in zip(_slow_readers_on_alternating_streams(g, inputs), wants):
        torch.testing.assert_close(copy, want, **TOL)


def _slow_readers_on_alternating_streams(g: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each call on the other of two streams, its output read slowly there (a spin of
    milliseconds, then a copy): what each call's stream copied out."""
    streams = [torch.cuda.Stream() for _ in range(2)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    copies = []
    for i, x in enumerate(inputs):
        with torch.cuda.stream(streams[i % 2]):
            out = g(x)
            torch.cuda._sleep(20_000_000)  # the reader is slow: milliseconds on this stream
            copies.append(out.clone())
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return copies


@torch.no_grad()
def test_buckets_of_one_pool_keep_call_order_across_streams() -> None:
    """Buckets share one pool and static buffers: a call on another stream, into another
    bucket, waits for the last bucket's replay and the copy of its output."""
    net = model()
    g = cg.graph(net, rand(8, 64), buckets={"B": [4, 8]})
    inputs = [rand(4 if i % 2 else 8, 64) for i in range(6)]
    for x in inputs:
        g(x)  # captured both
    wants = [net(x) for x in inputs]
    for copy, want in zip(_slow_readers_on_alternating_streams(g, inputs), wants):
        torch.testing.assert_close(copy, want, **TOL)
