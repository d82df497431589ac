"""Property tests: any pytree of tensors and plain values round-trips, and any reshaped leaf is named."""

from __future__ import annotations

import warnings

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cudagraphs as cg
from cudagraphs.core.signature import Signature

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
tensors = shapes.map(lambda s: torch.randn(s))
plain = st.one_of(
    st.integers(-5, 5), st.floats(-2, 2, allow_nan=False), st.text(max_size=3), st.booleans()
)
leaves = st.one_of(tensors, plain)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
    ),
    max_leaves=8,
)


def double_tensors(tree: object) -> object:
    return optree.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, tree)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_passthrough_matches_eager_on_any_tree(tree: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)
        g = cg.graph(double_tensors, tree)
        out = g(tree)
    expected = double_tensors(tree)
    assert optree.tree_structure(out) == optree.tree_structure(expected)
    for a, b in zip(optree.tree_leaves(out), optree.tree_leaves(expected)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b)
        else:
            assert a == b


@settings(max_examples=60, deadline=None)
@given(trees, st.data())
def test_a_reshaped_leaf_is_named_by_path(tree: object, data: st.DataObject) -> None:
    signature, leaves_ = Signature.of_call((tree,), {})
    if not signature.tensor_index:
        return
    k = data.draw(st.sampled_from(signature.tensor_index))
    changed = list(leaves_)
    changed[k] = torch.zeros(*leaves_[k].shape, 9)
    args, kwargs = optree.tree_unflatten(signature.spec, changed)
    try:
        signature.check(args, kwargs)
    except cg.InputMismatchError as error:
        assert str(error).startswith(signature.paths[k] + " has shape")
    else:
        raise AssertionError("a reshaped leaf was accepted")
