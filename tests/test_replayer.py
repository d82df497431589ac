"""The Python replay path (used where the compiled call path is not built) on the CPU, with a
stand-in graph: the previous outputs are marked dead after the launch, also when it fails."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cudagraphs.core import replayer as replayer_module
from cudagraphs.core.replayer import Counters, Replayer
from cudagraphs.core.tree import Signature


def stand_in(steps: list[str], failing: list[bool]) -> tuple[Replayer, torch.Tensor]:
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


def fast(replayer: Replayer, x: torch.Tensor) -> Any:
    call = replayer.entry(threading.RLock(), None, lambda args, kwargs: "general")
    assert call is not None
    return call(x)


@pytest.mark.parametrize("path", [general, static, fast], ids=lambda f: f.__name__)
def test_the_previous_outputs_are_marked_dead_after_the_launch(
    path: Callable[[Replayer, torch.Tensor], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replayer_module, "compiled_module", lambda: None)  # the Python path
    steps: list[str] = []
    failing: list[bool] = []
    replayer, x = stand_in(steps, failing)
    assert path(replayer, x) == "out"
    assert steps == ["replay", "invalidate", "emit"]
    steps.clear()
    failing.append(True)
    with pytest.raises(RuntimeError, match="launch failed"):
        path(replayer, x)
    assert steps == ["replay", "invalidate"]  # a failed launch may have overwritten them
