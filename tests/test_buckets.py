"""Shape buckets on the CPU: ladders, bucket choice, padding, slicing, overflow, errors.

The pass-through runs the same padding and slicing code as the GPU path (each bucket's
function call runs eagerly on the bucket's padded buffers), so everything but the replay itself
is tested here.
"""

from __future__ import annotations

import logging

import pytest
import torch

import cudagraphs as cg

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


def test_ladders() -> None:
    assert cg.powers_of_two(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert cg.powers_of_two(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert cg.powers_of_two(64, minimum=8) == [8, 16, 32, 64]
    assert cg.server_sizes(32, step=8) == [1, 2, 4, 8, 16, 24, 32]
    assert cg.server_sizes(20, step=8) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(cg.ConfigError, match="has no sizes"):
        cg.powers_of_two(0)


def test_bucket_choice_is_the_smallest_rung_at_or_above() -> None:
    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x * 2

    g = cg.graph(fn, torch.randn(3, 2), buckets={"B": [2, 5, 8]})
    seen.clear()
    for real, rung in [(1, 2), (2, 2), (3, 5), (5, 5), (6, 8), (8, 8)]:
        x = torch.randn(real, 2)
        torch.testing.assert_close(g(x), x * 2)
        assert seen[-1] == rung
    assert g.stats.hits == {(8,): 2, (5,): 2, (2,): 2}
    # padded elements over real elements: (1+0+2+0+2+0) rows of 2 over 25 rows of 2
    assert g.stats.padding_waste == pytest.approx(5 / 25)


def test_padding_uses_each_inputs_pad_value_and_is_restored() -> None:
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fn(tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        captured.append((tokens.clone(), feats.clone()))
        return feats.sum(-1) + tokens

    g = cg.graph(
        fn,
        torch.zeros(4, dtype=torch.long),
        torch.randn(4, 3),
        buckets=cg.Buckets({"B": [4, 8]}, pad={"args[0]": -1}),
    )
    tokens, feats = torch.arange(6), torch.randn(6, 3)
    out = g(tokens, feats)
    padded_tokens, padded_feats = captured[-1]
    assert padded_tokens.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    assert torch.equal(padded_feats[6:], torch.zeros(2, 3))
    torch.testing.assert_close(out, feats.sum(-1) + tokens)
    # A smaller call on the same bucket re-pads the rows the larger call wrote.
    g(torch.arange(5), torch.randn(5, 3))
    assert captured[-1][0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]


def test_two_symbols_with_a_mask_and_inferred_output_dims() -> None:
    def fn(x: torch.Tensor, mask: torch.Tensor) -> dict:
        weights = (~mask).float()
        pooled = (x * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp(min=1)
        return {"seq": x * 2, "pooled": pooled, "fixed": x.new_ones(3)}

    g = cg.graph(
        fn,
        torch.randn(2, 8, 4),
        torch.zeros(2, 8, dtype=torch.bool),
        buckets=cg.Buckets(
            {"B": [2, 4], "T": [8, 16]},
            dims={"args[0]": ("B", "T", None), "args[1]": ("B", "T")},
            pad={"args[1]": True},
        ),
    )
    assert len(g.stats.hits) == 4
    for b, t in [(1, 5), (2, 8), (3, 9), (4, 16)]:
        x, mask = torch.randn(b, t, 4), torch.rand(b, t) < 0.3
        got, expected = g(x, mask), fn(x, mask)
        assert got["seq"].shape == (b, t, 4) and got["pooled"].shape == (b, 4)
        torch.testing.assert_close(got, expected)


def test_output_dims_that_follow_no_single_symbol_need_a_declaration() -> None:
    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1)  # B*T: cannot be sliced back

    example = torch.randn(2, 4)
    spec = {"B": [2, 4], "T": [4, 8]}
    dims = {"args[0]": ("B", "T")}
    with pytest.raises(cg.ConfigError, match=r"cannot tell which symbol output out dimension 0"):
        cg.graph(flat, example, buckets=cg.Buckets(spec, dims=dims))
    # Declared, it is accepted (here: sliced by B only, as the user asked).
    g = cg.graph(flat, example, buckets=cg.Buckets(spec, dims=dims, out_dims={"out": ("B",)}))
    assert g(torch.randn(4, 8)).shape == (32,)


def test_single_rung_ladder_still_slices_outputs() -> None:
    g = cg.graph(lambda x: x + 1, torch.randn(3, 2), buckets={"B": [8]})
    x = torch.randn(5, 2)
    torch.testing.assert_close(g(x), x + 1)


def test_overflow_raise_eager_and_chunk(caplog: pytest.LogCaptureFixture) -> None:
    fn = lambda x: x * 3  # noqa: E731
    x = torch.randn(11, 2)
    raising = cg.graph(fn, torch.randn(2, 2), buckets={"B": [2, 4]})
    with pytest.raises(
        cg.BucketOverflowError, match=r"B=11 is above the largest bucket \(4; ladder \[2, 4\]\)"
    ):
        raising(x)
    assert isinstance(cg.BucketOverflowError("x"), cg.InputMismatchError)

    eager = cg.graph(fn, torch.randn(2, 2), buckets=cg.Buckets({"B": [2, 4]}, overflow="eager"))
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        torch.testing.assert_close(eager(x), x * 3)
        eager(x)
    assert len([r for r in caplog.records if "above the largest bucket" in r.getMessage()]) == 1
    assert eager.stats.overflows == 2 and eager.stats.eager_calls == 2

    chunk = cg.graph(fn, torch.randn(2, 2), buckets=cg.Buckets({"B": [2, 4]}, overflow="chunk"))
    torch.testing.assert_close(chunk(x), x * 3)  # 4 + 4 + 3 (padded to 4)
    assert chunk.stats.hits[(4,)] == 3


def test_chunk_refuses_outputs_that_do_not_follow_the_symbol() -> None:
    g = cg.graph(
        lambda x: x.sum(), torch.randn(2, 2), buckets=cg.Buckets({"B": [2, 4]}, overflow="chunk")
    )
    with pytest.raises(cg.BucketOverflowError, match="needs every tensor output to follow 'B'"):
        g(torch.randn(9, 2))


def test_mutated_bucketed_input_is_written_back() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum(-1)

    g = cg.graph(fn, torch.randn(4, 3), buckets={"B": [4, 8]})
    x = torch.randn(5, 3)
    expected_x = x * 2
    out = g(x)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, expected_x.sum(-1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"buckets": cg.Buckets({})}, "declares no symbol"),
        (
            {"buckets": cg.Buckets({"B": [0, 2]})},
            r"sizes\['B'\] must be a non-empty list of positive ints",
        ),
        (
            {"buckets": cg.Buckets({"B": [2], "T": [4]})},
            "several symbols .* but no dims declaration",
        ),
        ({"buckets": cg.Buckets({"B": [2]}, dims={"args[5]": ("B",)})}, r"dims names 'args\[5\]'"),
        (
            {"buckets": cg.Buckets({"B": [2]}, dims={"args[0]": ("B",)})},
            "1 dimensions declared for a 2-d tensor",
        ),
        (
            {"buckets": cg.Buckets({"B": [2]}, dims={"args[0]": ("T", None)})},
            "symbol 'T' has no ladder",
        ),
        ({"buckets": cg.Buckets({"B": [2]}, pad={"args[3]": 1})}, r"pad names 'args\[3\]'"),
        ({"buckets": cg.Buckets({"B": [2]}, overflow="drop")}, "overflow must be"),  # type: ignore[arg-type]
        ({"buckets": [1, 2]}, "buckets must be a cg.Buckets"),
        # One number is not a ladder: the error names the key and the ladder that fixes it.
        (
            {"buckets": {"B": 8}},
            r"buckets\['B'\] must be a ladder .* got int 8(.|\n)*cg.powers_of_two\(8\) "
            r"\(the sizes 1, 2, 4, 8\)",
        ),
        ({"buckets": {"B": None}}, r"buckets\['B'\] must be a ladder .* got NoneType"),
        ({"buckets": {"B": [4, "8"]}}, r"sizes\['B'\] must be a non-empty list of positive ints"),
        ({"buckets": "exact", "max_graphs": 0}, "max_graphs must be an int >= 1"),
    ],
)
def test_declaration_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(cg.ConfigError, match=message):
        cg.graph(lambda x: x, torch.randn(2, 3), **kwargs)


def test_call_errors_name_the_input() -> None:
    g = cg.graph(
        lambda x, y: x + y,
        torch.randn(2, 3),
        torch.randn(2, 3),
        buckets={"B": [2, 4]},
    )
    with pytest.raises(
        cg.InputMismatchError, match=r"symbol 'B' is 2 in args\[0\] dimension 0 but 3 in args\[1\]"
    ):
        g(torch.randn(2, 3), torch.randn(3, 3))
    with pytest.raises(
        cg.InputMismatchError,
        match=r"args\[1\] has size 4 in dimension 1 \(captured 3, not bucketed\)",
    ):
        g(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(cg.InputMismatchError, match=r"args\[0\] is torch.float64"):
        g(torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3))
    with pytest.raises(cg.InputMismatchError, match="unexpected"):
        g(torch.randn(2, 3), torch.randn(2, 3), torch.randn(1))


def test_exact_shapes_lru_and_warning() -> None:
    calls: list[tuple[int, ...]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x + 1

    g = cg.graph(fn, torch.randn(1, 2), buckets="exact", max_graphs=2)
    for n in (1, 2, 1, 3):
        x = torch.randn(n, 2)
        torch.testing.assert_close(g(x), x + 1)
    assert g.graphs == 2 and g.evictions == 1
    with pytest.warns(UserWarning, match="shapes keep changing"):
        g(torch.randn(4, 2))
        g(torch.randn(5, 2))


def test_lazy_decorator_with_buckets() -> None:
    @cg.graph(buckets={"B": [4, 8]})
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(AttributeError, match="not built yet"):
        double.stats  # noqa: B018
    x = torch.randn(6, 2)
    torch.testing.assert_close(double(x), x * 2)
    assert double.stats.hits[(8,)] == 1


def test_lazy_buckets_capture_on_first_use(stand_in: None) -> None:
    """Nothing is captured up front; a call captures its own rung only, and answers right."""
    g = cg.graph(
        lambda x: x - 1,
        torch.randn(2, 2),
        buckets=cg.Buckets({"B": [2, 4, 8]}, lazy=True),
        outputs="clone",  # guarded outputs need a CUDA build of torch
    )
    assert g.stats.hits == {} and g.state is cg.State.LAZY and g.stats.capture_s == {}
    x = torch.randn(3, 2)
    torch.testing.assert_close(g(x), x - 1)
    assert list(g.stats.hits) == [(4,)] and g.state is cg.State.CAPTURED
    assert list(g.stats.capture_s) == [(4,)]  # the other rungs are still not captured


def test_shared_pool_object_is_accepted() -> None:
    pool = cg.Pool()
    g = cg.graph(lambda x: x, torch.randn(2, 2), buckets={"B": [2]}, pool=pool)
    assert g.pool is pool
    with pytest.raises(cg.ConfigError, match=r"buckets share one cg\.Pool"):
        cg.graph(lambda x: x, torch.randn(2, 2), buckets={"B": [2]}, pool=(0, 1))
