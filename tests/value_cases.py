"""A module whose forward reads plain values of every kind, and a module global through a
helper: the cases of the value guards' tests (CPU and GPU)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from typing import Any

import torch
from torch import nn

GAIN = 1.0


def gained(x: torch.Tensor) -> torch.Tensor:  # a helper the graphed function calls
    return x * GAIN


class Kind(enum.Enum):
    DOUBLE = 2
    TRIPLE = 3


class Scaled(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)
        self.scale, self.shift, self.flip = 1.0, 0, False
        self.act, self.kind, self.offsets = "relu", Kind.DOUBLE, (0.0, 0.0)
        self.calls = 0  # a logging counter: declared harmless

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = gained(self.fc(x)) * self.scale + self.shift + self.offsets[1]
        y = y * self.kind.value
        y = torch.relu(y) if self.act == "relu" else torch.tanh(y)
        return -y if self.flip else y


#: case -> (attribute of Scaled, or "GAIN" of this module; the new value)
CHANGES = {
    "float": ("scale", 2.0),
    "int": ("shift", 3),
    "bool": ("flip", True),
    "str": ("act", "tanh"),
    "enum": ("kind", Kind.TRIPLE),
    "tuple": ("offsets", (0.0, 1.5)),
}


class Gained(nn.Module):
    """A forward that reads the module global ``GAIN``, which a saved compile's own guards
    cannot name."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * GAIN


class Slotted:
    __slots__ = ("function",)

    def __init__(self, function: Any) -> None:
        self.function = function


class HeldActivation(nn.Module):
    """A model whose activation function is chosen when it is built, held as an attribute,
    in a ``functools.partial`` or in an object with ``__slots__``: what neither a decision
    key nor a saved entry's guards name."""

    def __init__(self, activation: Any, held: str = "attribute", width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        if held == "partial":
            activation = functools.partial(activation)
        self.activation = Slotted(activation) if held == "slots" else activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = self.activation
        return (activation.function if isinstance(activation, Slotted) else activation)(self.fc(x))


def halved(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


POSTPROCESS = halved  # a module global holding a function, called by the forward below


class Activated(nn.Module):
    """Functions held in attributes and in a module global pick the kernels a recording
    launches, as a plain value does."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)
        self.activation = torch.relu
        self.squash = halved
        self.clip = functools.partial(torch.clamp, min=-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return POSTPROCESS(self.clip(self.squash(self.activation(self.fc(x)))))


#: case -> (attribute of Activated, or "POSTPROCESS" of this module; the new function)
CALLABLE_CHANGES = {
    "builtin": ("activation", torch.tanh),
    "function": ("squash", doubled),
    "partial": ("clip", functools.partial(torch.clamp, min=0.25)),
    "global": ("POSTPROCESS", doubled),
}


class Inner(nn.Module):
    """A child whose forward ``torch.compile`` inlines whole (no graph break): a plain value
    and a helper's global read only there."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gained(self.fc(x)) * self.gain


class Outer(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inner = Inner(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x))


class Policy:
    """An RL policy as a plain object of the user's class: its networks are attributes, not a
    module's children, and ``__call__`` reads them and a plain value."""

    def __init__(self, obs: int = 8, hidden: int = 16, actions: int = 4) -> None:
        self.body = nn.Linear(obs, hidden).requires_grad_(False)
        self.head = nn.Linear(hidden, actions).requires_grad_(False)
        self.temperature = 1.0
        self.extra = {"critic": nn.Linear(obs, actions).requires_grad_(False), "scale": 1.0}

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        action = torch.tanh(self.head(torch.relu(self.body(observations)))) / self.temperature
        return action + self.extra["critic"](observations) * self.extra["scale"]


NET = nn.Linear(8, 8).requires_grad_(False)  # a module global a step function reads


def step_with_net(x: torch.Tensor) -> torch.Tensor:
    return NET(x) * 2.0


def _replace_head(policy: Policy) -> None:
    policy.head = nn.Linear(16, 4).requires_grad_(False)


def _replace_parameter(policy: Policy) -> None:
    policy.body.weight = nn.Parameter(torch.randn(16, 8), requires_grad=False)


def _swap_data(policy: Policy) -> None:
    policy.body.weight.data = torch.randn(16, 8)


def _set_temperature(policy: Policy) -> None:
    policy.temperature = 2.0


def _replace_critic(policy: Policy) -> None:
    policy.extra["critic"] = nn.Linear(8, 4).requires_grad_(False)


def _set_scale(policy: Policy) -> None:
    policy.extra["scale"] = 0.5


#: case -> how the policy is changed after capture; each one must be seen before a replay
POLICY_CHANGES = {
    "module replaced": _replace_head,
    "parameter replaced": _replace_parameter,
    "data swapped": _swap_data,
    "plain value": _set_temperature,
    "module in a dict replaced": _replace_critic,
    "plain value in a dict": _set_scale,
}


class Defaulted(nn.Module):
    """Values read from the class rather than the instance: class-level defaults, a method,
    a child class that inherits them, and lists of plain values changed in place."""

    scale = 1.0  # a class-level default, read as self.scale
    flip = False

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)
        self.mix = [1.0, 0.5]
        self.cfg = {"weights": [1.0, -1.0]}

    def squash(self, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.squash(self.fc(x)) * self.scale * self.mix[0] + self.mix[1]
        y = y * self.cfg["weights"][0] + self.cfg["weights"][1]
        return -y if self.flip else y


class DefaultedChild(Defaulted):
    """Inherits every value above from :class:`Defaulted`."""


def _tanh_squash(self: Defaulted, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(y)


class TanhDefaulted(DefaultedChild):
    """Another class for the same object: another method under the same name."""

    def squash(self, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(y)


class ShiftedLinear(nn.Linear):
    """torch's ``nn.Linear`` with another forward, for a child whose class is swapped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


def _swap_class(model: Defaulted) -> None:
    model.__class__ = TanhDefaulted


def _swap_child_class(model: Defaulted) -> None:
    model.fc.__class__ = ShiftedLinear


def _change_list_item(model: Defaulted) -> None:
    model.mix[0] = 3.0


def _change_list_in_dict(model: Defaulted) -> None:
    model.cfg["weights"][1] = 0.25


#: case -> (a change made after the capture, given the model and a pytest monkeypatch;
#: a name the stale notice mentions)
BEYOND_ATTRIBUTES = {
    "default set on the instance": (lambda m, mp: setattr(m, "scale", 2.0), "scale"),
    "default changed on the class": (lambda m, mp: mp.setattr(type(m), "scale", 2.0), "scale"),
    "bool default set on the instance": (lambda m, mp: setattr(m, "flip", True), "flip"),
    "child class given its own value": (
        lambda m, mp: mp.setattr(DefaultedChild, "scale", 3.0, raising=False),
        "scale",
    ),
    "method replaced on the class": (
        lambda m, mp: mp.setattr(type(m), "squash", _tanh_squash),
        "squash",
    ),
    "method replaced on the instance": (
        lambda m, mp: setattr(m, "squash", _tanh_squash.__get__(m)),
        "squash",
    ),
    "list item changed in place": (lambda m, mp: _change_list_item(m), "mix"),
    "item of a list in a dict changed in place": (lambda m, mp: _change_list_in_dict(m), "weights"),
    "the model's class swapped": (lambda m, mp: _swap_class(m), "DefaultedChild's class"),
    "a child module's class swapped": (lambda m, mp: _swap_child_class(m), "fc's class"),
}


class Holding(nn.Module):
    """Tensors and modules a forward reads that are not parameters, buffers or children: a
    plain tensor attribute, a one-element tensor, tensors in a dict and a list, a module in a
    list, and a buffer it reads only if one is registered."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)
        self.offset = torch.randn(width)
        self.gain = torch.tensor(2.0)
        self.tables = {"shift": torch.randn(width)}
        self.steps = [torch.randn(width)]
        self.heads = [nn.Linear(width, width).requires_grad_(False)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.heads[0](self.fc(x)) * self.gain + self.offset
        y = y + self.tables["shift"] - self.steps[0]
        extra = getattr(self, "late", None)
        return y if extra is None else y + extra


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(t.shape, device=t.device, dtype=t.dtype)


def _linear_like(linear: nn.Linear) -> nn.Linear:
    fresh = nn.Linear(linear.in_features, linear.out_features, device=linear.weight.device)
    return fresh.requires_grad_(False)


def _equal_gain_then_written(model: Holding) -> None:
    model.gain = torch.tensor(
        2.0, device=model.gain.device
    )  # equal to the recorded one, but another tensor
    model.gain.fill_(3.0)  # written in place: eager reads it, a graph of the old one would not


#: case -> (a change made after the capture to a Holding, a name the stale notice mentions)
HELD_TENSORS = {
    "tensor attribute replaced": (lambda m: setattr(m, "offset", _like(m.offset)), "offset"),
    "tensor attribute's memory swapped": (
        lambda m: setattr(m.offset, "data", _like(m.offset)),
        "offset",
    ),
    "one-element tensor replaced by an equal one, then written": (_equal_gain_then_written, "gain"),
    "tensor in a dict replaced": (
        lambda m: m.tables.update(shift=_like(m.tables["shift"])),
        "shift",
    ),
    "tensor in a list replaced": (lambda m: m.steps.__setitem__(0, _like(m.steps[0])), "steps"),
    "module in a list replaced": (
        lambda m: m.heads.__setitem__(0, _linear_like(m.heads[0])),
        "heads",
    ),
    "buffer registered after capture": (
        lambda m: m.register_buffer("late", _like(m.offset)),
        "added to or removed from",
    ),
}


@dataclasses.dataclass
class Settings:
    """A config object of the user's own class, held in an attribute."""

    scale: float = 1.0


class Configured(nn.Module):
    """A forward that reads plain values through objects it holds: a dataclass, a namespace, a
    dict; the objects themselves may be rebound."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)
        self.settings = Settings()
        self.shift = types.SimpleNamespace(amount=0.0)
        self.table = {"gain": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * self.settings.scale + self.shift.amount
        return y * self.table["gain"]


#: case -> (a change made after the capture to a Configured, a name the stale notice mentions)
REBOUND_HOLDERS = {
    "a dataclass config rebound": (lambda m: setattr(m, "settings", Settings(3.0)), "settings"),
    "a namespace rebound": (
        lambda m: setattr(m, "shift", types.SimpleNamespace(amount=2.0)),
        "shift",
    ),
    "a dict rebound": (lambda m: setattr(m, "table", {"gain": -1.0}), "table"),
}


class GreedyPolicy(Policy):
    """Another class for a Policy object: another ``__call__``."""

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(observations)))


def mixed(x: torch.Tensor, mix: list[float], *, scale: float, net: nn.Module) -> torch.Tensor:
    return net(x) * scale * mix[0]


def mix_first(mix: list[float], x: torch.Tensor, *, scale: float, net: nn.Module) -> torch.Tensor:
    return mixed(x, mix, scale=scale, net=net)


class HoldsStep(nn.Module):
    """A model that calls a partial it holds (``model.fn = partial(...)``)."""

    def __init__(self, fn: functools.partial[torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def bound_step(change: str, device: str = "cpu") -> tuple[functools.partial[torch.Tensor], list]:
    """A partial over a network, a scale and a list (as keywords; for a change of the list's
    item, the list as its first argument), and that list."""
    mix = [1.0]
    net = nn.Linear(8, 8).requires_grad_(False).to(device)
    if change == "list item":
        return functools.partial(mix_first, mix, scale=1.0, net=net), mix
    return functools.partial(mixed, mix=mix, scale=1.0, net=net), mix


def _another_net(step: functools.partial[torch.Tensor]) -> None:
    device = step.keywords["net"].weight.device
    step.keywords["net"] = nn.Linear(8, 8).requires_grad_(False).to(device)


#: What a program changes in a partial after the capture (the partial, its list). The function
#: reads each as an argument, under no name a guard of attributes or globals keeps.
PARTIAL_CHANGES = {
    "keyword value": lambda step, mix: step.keywords.__setitem__("scale", 2.0),
    "keyword module": lambda step, mix: _another_net(step),
    "list item": lambda step, mix: mix.__setitem__(0, 3.0),
}


@dataclasses.dataclass(slots=True)
class SlottedInner:
    factor: float


@dataclasses.dataclass(slots=True)
class SlottedSettings:
    scale: float
    mix: list[float]
    gain: torch.Tensor
    inner: SlottedInner  # reached only by entering the slotted object that holds it


class SlottedModel(nn.Module):
    """A model whose settings are a ``@dataclass(slots=True)``: no ``__dict__`` to read."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False).to(device)
        self.settings = SlottedSettings(1.0, [1.0], torch.ones(8, device=device), SlottedInner(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        settings = self.settings
        return self.fc(x) * settings.scale * settings.mix[0] * settings.gain * settings.inner.factor


#: What a program changes in a SlottedModel's settings after the capture.
SLOT_CHANGES = {
    "slot value": lambda s: setattr(s, "scale", 2.0),
    "list item in a slot": lambda s: s.mix.__setitem__(0, 3.0),
    "slot rebound": lambda s: setattr(s, "mix", [0.5]),
    "tensor in a slot replaced": lambda s: setattr(s, "gain", torch.full_like(s.gain, 2.0)),
    "value in a slotted object in a slot": lambda s: setattr(s.inner, "factor", 2.0),
}


class NumpyScaled(nn.Module):
    """Settings held as NumPy values: a scalar (``np.float32``, not a Python float) and a small
    table whose items the forward reads."""

    def __init__(self, width: int = 8, device: str = "cpu") -> None:
        import numpy

        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False).to(device)
        self.scale, self.table = numpy.float32(1.0), numpy.array([[1.0, 2.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table
        return self.fc(x) * float(self.scale) * float(table.reshape(-1)[1]) * table.shape[0]


def _numpy_change(kind: str) -> Any:
    import numpy

    return {
        "scalar": lambda m: setattr(m, "scale", numpy.float32(2.0)),
        "array item": lambda m: m.table.__setitem__((0, 1), 5.0),
        "array reshaped in place": lambda m: setattr(m.table, "shape", (2, 1)),
        "array made 1-D in place": lambda m: setattr(m.table, "shape", (2,)),
        "array replaced": lambda m: setattr(m, "table", numpy.array([[1.0, 7.0]])),
    }[kind]


#: What a program changes in a NumpyScaled after the capture (a reshape in place changes what
#: the forward computes with the shape, not one byte of the array).
NUMPY_CHANGES = [
    "scalar", "array item", "array reshaped in place", "array made 1-D in place", "array replaced"
]  # fmt: skip


def labels_read_under_compile(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """What the value guard would check after a capture of ``torch.compile(model)``: the
    values read by the code the capture's reader counts as run."""
    from cudagraphs.core import PythonSnapshot, Reader, read_values

    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(x)  # compiles: the capture sees only the compiled frame
        snapshot = PythonSnapshot(compiled)
        with Reader(of=compiled) as reader:
            compiled(x)
        snapshot.take()
    read = read_values(reader, snapshot.runs[-1], (), snapshot.objects)  # as the capture does
    return [label for label, _, _, _ in read]
