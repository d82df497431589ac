"""Buckets on a real GPU: every bucket equals eager on the unpadded input; one pool for all."""

from __future__ import annotations

import random

import pytest
import torch

import cudagraphs as cg
from cudagraphs.tools.workloads import mlp_256, transformer

pytestmark = pytest.mark.cuda


def test_mlp_batch_buckets_match_eager_for_every_bucket() -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    model = mlp_256().cuda().eval()
    ladder = cg.powers_of_two(128)
    with torch.no_grad():
        g = cg.graph(model, torch.randn(128, 256, device="cuda"), buckets={"B": ladder})
        assert g.state is cg.State.CAPTURED and len(g.stats.hits) == len(ladder)
        lower = 0
        for rung in ladder:
            for real in {rung, lower + 1, rng.randint(lower + 1, rung)}:
                x = torch.randn(real, 256, device="cuda")
                torch.testing.assert_close(g(x), model(x), rtol=1e-5, atol=1e-5)
            lower = rung
    assert all(hits >= 1 for hits in g.stats.hits.values())


def test_transformer_with_key_padding_mask_on_batch_and_sequence_buckets() -> None:
    torch.manual_seed(0)
    rng = random.Random(1)
    model = transformer().cuda().eval()
    spec = cg.Buckets(
        {"B": [1, 2, 4, 8], "T": [16, 32, 64]},
        dims={"args[0]": ("B", "T", None), "kwargs['src_key_padding_mask']": ("B", "T")},
        pad={"kwargs['src_key_padding_mask']": True},  # padded keys are masked out
    )
    with torch.no_grad():
        x = torch.randn(8, 64, 256, device="cuda")
        mask = torch.zeros(8, 64, dtype=torch.bool, device="cuda")
        g = cg.graph(model, x, src_key_padding_mask=mask, buckets=spec)
        assert len(g.stats.hits) == 12
        for b_rung in (1, 2, 4, 8):
            for t_rung in (16, 32, 64):
                b = rng.randint(max(1, b_rung // 2), b_rung)
                t = rng.randint(t_rung // 2 + 1, t_rung)
                x = torch.randn(b, t, 256, device="cuda")
                lengths = torch.tensor([rng.randint(1, t) for _ in range(b)], device="cuda")
                mask = torch.arange(t, device="cuda")[None, :] >= lengths[:, None]
                got = g(x, src_key_padding_mask=mask)
                expected = model(x, src_key_padding_mask=mask)
                assert got.shape == (b, t, 256)
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_eight_transformer_buckets_share_one_pool() -> None:
    model = transformer().cuda().eval()
    with torch.no_grad():
        alone = cg.graph(model, torch.randn(128, 64, 256, device="cuda"))
        largest = alone.stats.pool_bytes
        del alone
        torch.cuda.empty_cache()
        g = cg.graph(
            model, torch.randn(128, 64, 256, device="cuda"), buckets={"B": cg.powers_of_two(128)}
        )
        total = g.stats.pool_total_bytes
    print(
        f"largest bucket alone: {largest / 2**20:.1f} MiB; 8 buckets in one pool: {total / 2**20:.1f} MiB"
    )
    assert largest > 0
    assert total <= 1.25 * largest, (total, largest)


def test_guarded_outputs_of_a_bucket_go_stale_on_its_next_replay() -> None:
    g = cg.graph(lambda x: x * 2, torch.randn(4, 3, device="cuda"), buckets={"B": [4, 8]})
    a = g(torch.ones(3, 3, device="cuda"))
    torch.testing.assert_close(a, torch.full((3, 3), 2.0, device="cuda"))
    g(torch.ones(4, 3, device="cuda"))
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        a.sum()


def test_exact_shapes_on_gpu_evict_and_stay_correct() -> None:
    model = mlp_256().cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(4, 256, device="cuda"), buckets="exact", max_graphs=2)
        for n in (4, 8, 4, 16, 8):
            x = torch.randn(n, 256, device="cuda")
            torch.testing.assert_close(g(x), model(x))
    assert g.graphs == 2 and g.evictions == 2


def test_fast_path_pads_and_repads_the_tail() -> None:
    # The second output reduces over the whole padded batch, so it sees the tail: with pad 0
    # it equals the sum of the real rows only if the tail was (re)filled correctly.
    def fn(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x * 1, x.sum(0), ids.min()

    g = cg.graph(
        fn,
        torch.randn(8, 3, device="cuda"),
        torch.zeros(8, dtype=torch.long, device="cuda"),
        buckets=cg.Buckets({"B": [4, 8]}, pad={"args[1]": -1}),
    )
    for n in (8, 6, 5, 7, 5, 8):
        x = torch.randn(n, 3, device="cuda")
        ids = torch.arange(n, device="cuda")
        rows, total, smallest = g(x, ids)
        torch.testing.assert_close(rows, x)
        torch.testing.assert_close(total, x.sum(0))
        assert smallest.item() == (0 if n == 8 else -1)
    # 39 real rows and 9 padded ones, in x (3 columns) and ids (1 column).
    assert g.stats.hits[(8,)] == 6
    assert g.stats.padding_waste == pytest.approx((9 * 3 + 9) / (39 * 3 + 39))


@torch.no_grad()
def test_a_cpu_tensor_into_a_captured_batch_bucket_is_refused_naming_the_input() -> None:
    """The batch fast path checks each input's device: a CPU tensor of a bucketed shape would
    otherwise be copied into the bucket's CUDA buffer across devices. Refused, then the next
    CUDA call still equals eager. (The row of scripts/break-guards that no CPU test can fail.)"""
    model = mlp_256().cuda().eval()
    g = cg.graph(model, torch.randn(16, 256, device="cuda"), buckets={"B": [4, 8, 16]})
    x = torch.randn(3, 256, device="cuda")
    torch.testing.assert_close(g(x).clone(), model(x))  # the 4-row bucket: fast from here
    with pytest.raises(cg.InputMismatchError, match=r"args\[0\]"):
        g(torch.randn(3, 256))
    y = torch.randn(3, 256, device="cuda")
    torch.testing.assert_close(g(y).clone(), model(y))
