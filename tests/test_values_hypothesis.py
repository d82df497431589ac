"""Property test of the value guard over values read beyond the instance: after any sequence of
changes to a model's class, a base class, the instance and a list it holds, a change of what
the forward reads is never missed, and the C check and its Python form agree."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudagraphs.core import PythonSnapshot, Reader, ValueWatch, read_values
from cudagraphs.core.guards import compiled_module


def _squash(self: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(y)


def _other_squash(self: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(y)


def _classes() -> tuple[type, type]:
    """A fresh base and child per example: the changes below never leak between examples."""

    class Base(nn.Module):
        scale = 1.0
        squash = _squash

        def __init__(self) -> None:
            super().__init__()
            self.mix = [1.0, 0.5]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.squash(x) * self.scale * self.mix[0] + self.mix[1]

    class Child(Base):
        pass

    return Base, Child


values = st.sampled_from([1.0, 2.0, -1.0])
changes = st.one_of(
    st.tuples(st.just("base scale"), values),
    st.tuples(st.just("child scale"), values),
    st.tuples(st.just("drop child scale"), st.none()),
    st.tuples(st.just("instance scale"), values),
    st.tuples(st.just("drop instance scale"), st.none()),
    st.tuples(st.just("list item"), st.tuples(st.integers(0, 1), values)),
    st.tuples(st.just("method on base"), st.sampled_from([_squash, _other_squash])),
    st.tuples(st.just("method on instance"), st.sampled_from([_squash, _other_squash])),
)


def _apply(change: tuple[str, Any], base: type, child: type, model: nn.Module) -> None:
    what, value = change
    if what == "base scale":
        base.scale = value
    elif what == "child scale":
        child.scale = value
    elif what == "drop child scale" and "scale" in vars(child):
        del child.scale
    elif what == "instance scale":
        model.scale = value
    elif what == "drop instance scale" and "scale" in vars(model):
        del model.scale
    elif what == "list item":
        model.mix[value[0]] = value[1]
    elif what == "method on base":
        base.squash = value
    elif what == "method on instance":
        model.squash = value.__get__(model)


def _reads(model: nn.Module) -> tuple[Any, ...]:
    """What the forward computes with: the values it reads, the method by its function."""
    return (model.scale, model.squash.__func__, tuple(model.mix))


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
@settings(max_examples=80, deadline=None)
@given(steps=st.lists(changes, max_size=5))
def test_no_change_of_what_the_forward_reads_is_missed(native: bool, steps: list[Any]) -> None:
    if native and compiled_module() is None:
        pytest.skip("no compiled check here")
    base, child = _classes()
    model = child()
    x = torch.randn(2, 3)
    snapshot = PythonSnapshot(model)
    with torch.no_grad(), Reader(of=model) as reader:
        model(x)
    snapshot.take()
    watch = ValueWatch(read_values(reader, snapshot.runs[-1], (), snapshot.objects))
    recorded = _reads(model)
    assert watch.stale() is None
    for change in steps:
        _apply(change, base, child, model)
    same = watch._same() if native else watch._same_in_python()
    assert same == watch._same_in_python()  # the C check and its Python form agree
    if _reads(model) != recorded:
        assert not same, (steps, watch.values)  # a change of what the forward reads is seen
        assert watch.stale() is not None


class _NumpyRead(nn.Module):
    """Reads a NumPy scalar and a small array (guarded by its memory); a large one (past
    ``ARRAY_BYTES``) is refused at capture (``test_reads_seen.py``)."""

    def __init__(self) -> None:
        import numpy

        super().__init__()
        self.scale, self.table = numpy.float32(1.0), numpy.array([[1.0, 2.0, 3.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(self.scale) * float(self.table.sum()) * self.table.shape[0]


def _numpy_changes() -> Any:
    import numpy

    numbers = st.sampled_from([1.0, 2.0, 3.0])
    return st.one_of(
        st.tuples(st.just("scale"), numbers.map(numpy.float32)),
        st.tuples(st.just("scale as float64"), numbers.map(numpy.float64)),
        st.tuples(st.just("table item"), st.tuples(st.integers(0, 2), numbers)),
        st.tuples(st.just("table reshaped"), st.sampled_from([(1, 3), (3, 1), (3,)])),
        st.tuples(st.just("table replaced"), st.lists(numbers, min_size=3, max_size=3)),
    )


def _apply_numpy(change: tuple[str, Any], model: _NumpyRead) -> None:
    import numpy

    what, value = change
    if what.startswith("scale"):
        model.scale = value
    elif what == "table item":
        model.table.reshape(-1)[value[0]] = value[1]  # a view: the same memory
    elif what == "table reshaped":
        model.table.shape = value
    else:  # "table replaced"
        model.table = numpy.array(value)


def _numpy_reads(model: _NumpyRead) -> tuple[Any, ...]:
    return (
        type(model.scale), float(model.scale), model.table.tobytes(), model.table.shape,
        id(model.table),
    )  # fmt: skip


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_no_change_of_a_numpy_value_the_forward_reads_is_missed(native: bool, data: Any) -> None:
    """A change of what the forward reads is seen; an equal scalar, or an item set to its own
    value, is not a change; the C check and its Python form agree."""
    if native and compiled_module() is None:
        pytest.skip("no compiled check here")
    steps = data.draw(st.lists(_numpy_changes(), max_size=4))
    model = _NumpyRead()
    snapshot = PythonSnapshot(model)
    with torch.no_grad(), Reader(of=model) as reader:
        model(torch.randn(2, 3))
    snapshot.take()
    watch = ValueWatch(read_values(reader, snapshot.runs[-1], (), snapshot.objects))
    recorded = _numpy_reads(model)
    for change in steps:
        _apply_numpy(change, model)
    same = watch._same() if native else watch._same_in_python()
    assert same == watch._same_in_python()  # the C check and its Python form agree
    assert same == (_numpy_reads(model) == recorded), (steps, watch.values)
