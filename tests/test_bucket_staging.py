"""Bucketed inputs share one buffer per input across buckets: whatever order calls of different
sizes arrive in, every replay must see the caller's data in its leading box and the pad value
everywhere else (a stale row from an earlier, larger call would change the answer)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudagraphs as cg


def row_sums(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=1) * 2  # pad 0 adds nothing; a stale value would


def column_sums(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=0, keepdim=True)  # sums over the pad rows too: any stale row shows


def masked_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(dim=1) + mask.sum(dim=1)  # any non-pad leftover shows


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sizes=st.lists(st.integers(1, 16), min_size=1, max_size=12))
def test_batch_buckets_in_any_order_equal_eager(stand_in: None, sizes: list[int]) -> None:
    rows = cg.graph(row_sums, torch.randn(16, 5), buckets={"B": [2, 4, 8, 16]}, outputs="clone")
    columns = cg.graph(
        column_sums, torch.randn(16, 5), buckets={"B": [2, 4, 8, 16]}, outputs="alias"
    )
    for n in sizes:
        x = torch.randn(n, 5)
        torch.testing.assert_close(rows(x), row_sums(x))
        torch.testing.assert_close(columns(x), column_sums(x))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 8)), min_size=1, max_size=10))
def test_two_symbol_buckets_in_any_order_equal_eager(
    stand_in: None, shapes: list[tuple[int, int]]
) -> None:
    buckets = cg.Buckets(
        {"B": [2, 4], "T": [4, 8]},
        dims={"args[0]": ("B", "T"), "args[1]": ("B", "T")},
        pad={"args[1]": 0.0},
    )
    g = cg.graph(masked_sums, torch.randn(4, 8), torch.ones(4, 8), buckets=buckets, outputs="clone")
    for b, t in shapes:
        x, mask = torch.randn(b, t), (torch.rand(b, t) > 0.3).float()
        torch.testing.assert_close(g(x, mask), masked_sums(x, mask))


def test_a_call_at_an_exact_rung_leaves_later_smaller_calls_padded(stand_in: None) -> None:
    # 5 rows (rung 8: rows 5..8 padded), then 8 (an exact rung, replayed through the bucket's
    # own call path, which writes all 8 rows), then 6: rows 6..8 held the 8-row call's data and
    # must be pad again.
    g = cg.graph(column_sums, torch.randn(8, 5), buckets={"B": [4, 8]}, outputs="clone")
    for n in (5, 8, 6, 3, 4, 8, 1, 7):
        x = torch.randn(n, 5)
        torch.testing.assert_close(g(x), column_sums(x))
    assert g.stats.hits == {(4,): 3, (8,): 5}


def test_the_batch_fast_path_refuses_a_size_or_dtype_the_copy_would_broadcast_or_cast(
    stand_in: None,
) -> None:
    """A captured batch bucket's fast path: a (3, 1) input would broadcast into the (4, 5)
    buffer's first rows and a float64 one would be cast, silently; both are refused, naming
    the input, and the call after them still equals eager."""
    import pytest

    g = cg.graph(row_sums, torch.randn(16, 5), buckets={"B": [2, 4, 8, 16]}, outputs="clone")
    x = torch.randn(3, 5)
    torch.testing.assert_close(g(x), row_sums(x))  # captures the 4-row bucket: fast from here
    with pytest.raises(cg.InputMismatchError, match=r"args\[0\] has size 1 in dimension 1"):
        g(torch.randn(3, 1))
    with pytest.raises(cg.InputMismatchError, match=r"args\[0\] is torch.float64"):
        g(torch.randn(3, 5, dtype=torch.float64))
    y = torch.randn(3, 5)
    torch.testing.assert_close(g(y), row_sums(y))
