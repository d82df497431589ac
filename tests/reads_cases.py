"""Models whose forward reads Python values in ways the names of its code do not show: a name
built at run time, a key held in an attribute, a helper's closure, the closure of the function
that defined the forward, long and nested lists, host settings read through torch. The cases of
``test_reads_seen.py`` (CPU stand-in) and its GPU twin."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class NamedAtRunTime(nn.Module):
    """``getattr(self, f"w{i}")``: no code of the forward names ``w1``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.w0, self.w1, self.w2 = 1.0, 0.5, 0.25

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return sum(y * getattr(self, f"w{i}") for i in range(3))


class KeyedAtRunTime(nn.Module):
    """``self.ws[f"w{i}"]``: a dict read with keys built at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.ws = {"w0": 1.0, "w1": 0.5, "w2": 0.25}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return sum(y * self.ws[f"w{i}"] for i in range(3))


class KeyInAttribute(nn.Module):
    """``self.settings[self.key]``: the key is a value, not a name of the code."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.settings = {"small": 0.5, "large": 2.0}
        self.key = "small"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.settings[self.key]


def _scaler() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[float], None]]:
    factor = 2.0

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    def set_factor(value: float) -> None:
        nonlocal factor
        factor = value

    return scale, set_factor


SCALE, SET_SCALE_FACTOR = _scaler()  # a module-level helper with a closure, and its setter


class CallsAHelper(nn.Module):
    """A forward that calls a module-level helper whose closure holds the factor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SCALE(self.fc(x))


def defined_in_a_function() -> tuple[nn.Module, Callable[[float], None]]:
    """A model class defined inside a function: its forward reads that function's variable."""
    factor = 2.0

    class Local(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8).requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * factor

    def set_factor(value: float) -> None:
        nonlocal factor
        factor = value

    return Local(), set_factor


class LongList(nn.Module):
    """A list of 100 floats, one of them read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.weights = [1.0] * 100

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.weights[37]


class NestedList(nn.Module):
    """``self.mix[0][1]``: the inner list is changed in place, the outer one keeps its items."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.mix = [[1.0, 0.5], [0.25, 2.0]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.mix[0][1]


class ThreadsBranch(nn.Module):
    """A branch on a host setting read through a torch function."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2.0 if torch.get_num_threads() > 1 else y - 1.0


class MkldnnBranch(nn.Module):
    """A branch on a flag of ``torch.backends`` (a property of a module object)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2.0 if torch.backends.mkldnn.enabled else y - 1.0


class SdpBranch(nn.Module):
    """A branch on a setting read through a public Python function of torch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2.0 if torch.backends.cuda.flash_sdp_enabled() else y - 1.0


#: The environment variable ``ReadsTheEnvironment`` reads; the tests set it back after each case.
SCALE_VARIABLE = "CUDAGRAPHS_TEST_SCALE"


class ReadsTheEnvironment(nn.Module):
    """A branch on an environment variable (as transformers' SDPA attention reads one)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 3.0 if os.environ.get(SCALE_VARIABLE, "0") == "1" else y


def answers_as_eager_after(
    model: nn.Module,
    change: Callable[[nn.Module], None],
    name: str | None = None,
    *,
    compile: bool = False,
    device: str = "cpu",
) -> None:
    """Capture ``model``, make the change, and check that the next call gives eager's answer
    (not the recorded one) through one new capture, whose notice names ``name`` where given,
    and that the call after it replays that capture."""
    import cudagraphs as cg

    torch.manual_seed(0)
    g = cg.graph(model, torch.randn(4, 8, device=device), outputs="clone", compile=compile)
    fresh = torch.randn(4, 8, device=device)
    recorded = g(fresh)
    torch.testing.assert_close(recorded, model(fresh))
    change(model)
    expected = model(fresh)
    assert not torch.allclose(expected, recorded)  # the change matters to the answer
    torch.testing.assert_close(g(fresh), expected)
    assert g.stats.recaptures == 1
    if name is not None:
        assert any(name in notice for notice in g.stats.notices), g.stats.notices
    again = torch.randn(4, 8, device=device)
    torch.testing.assert_close(g(again), model(again))
    assert g.stats.recaptures == 1  # the new value is the recorded one now


def _set(name: str, value: Any) -> Callable[[nn.Module], None]:
    return lambda model: setattr(model, name, value)


def _set_item(name: str, key: Any, value: Any) -> Callable[[nn.Module], None]:
    return lambda model: getattr(model, name).__setitem__(key, value)


def _set_inner(model: nn.Module) -> None:
    model.mix[0][1] = 3.0


#: case -> (make the model, change it after the capture, a word the recapture's notice names)
SEEN = {
    "getattr with a name built at run time": (NamedAtRunTime, _set("w1", 3.0), "w1"),
    "dict key built at run time": (KeyedAtRunTime, _set_item("ws", "w1", 3.0), "w1"),
    "dict key held in an attribute": (
        KeyInAttribute,
        _set_item("settings", "small", 3.0),
        "small",
    ),
    "closure of a module-level helper": (
        CallsAHelper,
        lambda model: SET_SCALE_FACTOR(3.0),
        "factor",
    ),
    "list of 100 floats changed in place": (LongList, _set_item("weights", 37, 3.0), "weights"),
    "nested list changed in place": (NestedList, _set_inner, "mix"),
    "environment variable read in a branch": (
        ReadsTheEnvironment,
        lambda model: os.environ.__setitem__(SCALE_VARIABLE, "1"),
        SCALE_VARIABLE,
    ),
}


class ReadsTheClock(nn.Module):
    """A branch on the host's clock: a result no guard can compare before a replay."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.started = time.perf_counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2.0 if time.perf_counter() - self.started > 3600.0 else y
