"""The launcher on the CPU: where the one-C-call launch is available (a CUDA build of torch,
with or without a GPU), an object that is not a torch CUDA graph, such as the suite's stand-in
recording, is launched by its own ``replay()`` and never asks CUDA for a device."""

from __future__ import annotations

import pytest
import torch

from cudagraphs.core import launch


class Replays:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_an_object_that_is_not_a_cuda_graph_is_only_replayed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_device() -> int:
        raise AssertionError("the launcher asked CUDA for the current device")

    def no_c_launch(*_: object) -> int:
        raise AssertionError("the launcher made a C launch of an object that is not a graph")

    monkeypatch.setattr(launch, "_native", lambda: (no_c_launch, 1, 2, 3, 4))
    monkeypatch.setattr(torch.cuda, "current_device", no_device)
    graph = Replays()
    launcher = launch.Launcher(graph)  # type: ignore[arg-type]
    for _ in range(5):
        launcher()
    assert graph.replays == 5
    assert not launcher.direct
