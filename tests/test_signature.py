"""Signatures and their errors, on the CPU: structure, shapes, dtypes, devices, frozen values."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch

import cudagraphs as cg
from cudagraphs.core.signature import Signature, flatten, leaf_paths, same_value


def sig(*args: object, **kwargs: object) -> Signature:
    return Signature.of_call(args, kwargs)[0]


def test_paths_name_args_kwargs_and_nesting() -> None:
    s = sig({"obs": torch.zeros(2), "n": 3}, [1.0, torch.ones(1)], temperature=0.5)
    assert s.paths == [
        "args[0]['n']",
        "args[0]['obs']",
        "args[1][0]",
        "args[1][1]",
        "kwargs['temperature']",
    ]
    assert s.tensor_paths() == ["args[0]['obs']", "args[1][1]"]
    assert s.frozen_values == (3, 1.0, 0.5)


def test_namedtuple_and_dataclass_paths() -> None:
    Point = collections.namedtuple("Point", "x y")

    @dataclasses.dataclass
    class Box:
        lo: torch.Tensor
        hi: torch.Tensor

    s = sig(Point(torch.zeros(1), 2), Box(torch.zeros(2), torch.ones(2)))
    assert s.paths == ["args[0].x", "args[0].y", "args[1].lo", "args[1].hi"]
    assert len(s.tensor_index) == 3


def test_flat_signature_is_detected() -> None:
    assert sig(torch.zeros(1), 3).is_flat
    assert not sig(torch.zeros(1), k=1).is_flat
    assert not sig((torch.zeros(1),)).is_flat
    assert not sig(None).is_flat  # None is structure, not a leaf


@pytest.mark.parametrize(
    "call, message",
    [
        (((torch.zeros(3, 4),), {}), r"missing args\[0\]\['x'\]; unexpected args\[0\]"),
        ((({"x": torch.zeros(2)},), {}), r"args\[0\]\['x'\] has shape \(2,\) \(captured \(3,\)\)"),
        (
            (({"x": torch.zeros(3, dtype=torch.int64)},), {}),
            r"dtype torch.int64 \(captured torch.float32\)",
        ),
        ((({"x": torch.zeros(3), "y": torch.zeros(1)},), {}), r"unexpected args\[0\]\['y'\]"),
        ((({},), {}), r"missing args\[0\]\['x'\]"),
        ((({"x": torch.zeros(3)},), {"k": 1}), r"unexpected kwargs\['k'\]"),
        ((({"x": 3},), {}), r"args\[0\]\['x'\] is 3 but the graph was captured with Tensor"),
        ((([torch.zeros(3)],), {}), "containers differ|missing"),
    ],
)
def test_check_names_the_leaf_and_says_why_and_how(call: tuple, message: str) -> None:
    s = sig({"x": torch.zeros(3)})
    args, kwargs = call
    with pytest.raises(cg.InputMismatchError, match=message) as info:
        s.check(args, kwargs)
    text = str(info.value)
    assert "why:" in text and "fix:" in text


def test_frozen_values_compare_by_type_and_value() -> None:
    s = sig(torch.zeros(1), 2, flag=True)
    s.check((torch.ones(1), 2), {"flag": True})
    with pytest.raises(
        cg.InputMismatchError, match=r"kwargs\['flag'\] is 1 but .* captured with True"
    ):
        s.check((torch.ones(1), 2), {"flag": 1})
    with pytest.raises(cg.InputMismatchError, match=r"args\[1\] is 2.0"):
        s.check((torch.ones(1), 2.0), {"flag": True})


def test_same_value_handles_objects_without_plain_equality() -> None:
    array = np.arange(3)
    assert same_value(array, array)
    assert not same_value(np.arange(3), array)  # == gives an array: only identity counts
    assert same_value("a", "a") and not same_value(1, True)
    assert not same_value(float("nan"), float("nan"))


def test_leaf_paths_with_custom_root() -> None:
    _, spec = flatten({"a": [1, 2]})
    assert leaf_paths(spec, root="out") == ["out['a'][0]", "out['a'][1]"]
