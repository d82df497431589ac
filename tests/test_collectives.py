"""Collectives across ranks, on the CPU with the gloo backend in two processes: what a run
issues is recorded, the records are compared through the process group, a mismatch raises
CollectiveMismatchError on every rank (not a hang), and the pass-through runs collectives
eagerly under a gloo process group."""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port

import cudagraphs as cg
from cudagraphs.core.collectives import CollectiveLog, compare_across_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _worker(rank: int, world: int, port: int, scenario: str, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, SCENARIOS[scenario](rank)))
    except Exception as error:  # reported to the test, which asserts on it
        results.put((rank, f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"))
    finally:
        dist.destroy_process_group()


def recorded_and_compared(rank: int) -> Any:
    x = torch.ones(8) * (rank + 1)
    with CollectiveLog() as log:
        dist.all_reduce(x)
        dist.broadcast(x, 0)
    compare_across_ranks(log, name="step")
    return log.describe(), x.tolist()


def mismatched(rank: int) -> Any:
    # As a capture records without running: rank 1's graph holds one all-reduce more.
    log = CollectiveLog()
    log.entries.append(("allreduce_", (((1024,), "float32"),)))
    if rank == 1:
        log.entries.append(("allreduce_", (((16,), "float32"),)))
    compare_across_ranks(log, name="train_step", timeout_s=20)
    return "no error"


def resized(rank: int) -> Any:
    log = CollectiveLog()
    log.entries.append(("allreduce_", (((1024 if rank == 0 else 512,), "float32"),)))
    compare_across_ranks(log, name="decode", timeout_s=20)
    return "no error"


def pass_through(rank: int) -> Any:
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)
        graphed = cg.graph(step, torch.zeros(4))
        return [graphed(torch.full((4,), float(rank + k))).tolist() for k in range(3)]


def ddp_train_step(rank: int) -> Any:
    """cg.train_step over a DistributedDataParallel model (the pass-through here) against the
    same DDP training written plainly: after 10 steps the parameters are equal on each rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(graphed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = DDP(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        run = cg.train_step(step, optimizer=opt) if graphed else step
        data = torch.Generator().manual_seed(rank)  # each rank its own shard
        for _ in range(10):
            run(torch.randn(4, 8, generator=data), torch.randn(4, 2, generator=data))
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, graphed = train(False), train(True)
    synced = [t.clone() for t in graphed]
    for t in synced:  # DDP keeps ranks equal: rank 0's parameters, everywhere
        dist.broadcast(t, 0)
    return all(torch.equal(a, b) for a, b in zip(eager, graphed)), all(
        torch.equal(a, b) for a, b in zip(graphed, synced)
    )


def fsdp_train_step(rank: int) -> Any:
    """cg.train_step over a model sharded on two ranks with fully_shard (the pass-through
    here) against the same FSDP2 training written plainly: equal gathered parameters."""
    from torch.distributed.fsdp import fully_shard

    def train(graphed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        fully_shard(model[0])
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss

        run = cg.train_step(step, optimizer=opt) if graphed else step
        data = torch.Generator().manual_seed(rank)
        for _ in range(6):
            run(torch.randn(4, 8, generator=data), torch.randn(4, 2, generator=data))
        shards = [p.to_local().shape[0] for p in model.parameters()]
        return [p.full_tensor().detach() for p in model.parameters()], shards

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (eager, shards), (graphed, _) = train(False), train(True)
    return all(torch.equal(a, b) for a, b in zip(eager, graphed)), shards


def tensor_parallel(rank: int) -> Any:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import tensor_parallel as example

    return example.check(rank, 2, torch.device("cpu"))["max_abs_error"]


SCENARIOS = {
    "tensor_parallel": tensor_parallel,
    "ddp_train_step": ddp_train_step,
    "fsdp_train_step": fsdp_train_step,
    "recorded": recorded_and_compared,
    "mismatched": mismatched,
    "resized": resized,
    "pass_through": pass_through,
}


def run_two_ranks(scenario: str) -> dict[int, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, 2, port, scenario, results)) for rank in (0, 1)
    ]
    for p in processes:
        p.start()
    answers = dict(results.get(timeout=90) for _ in processes)
    for p in processes:
        p.join(30)
    return answers


@pytest.mark.slow
def test_collectives_are_recorded_and_equal_records_pass() -> None:
    answers = run_two_ranks("recorded")
    for rank in (0, 1):
        record, values = answers[rank]
        assert record == ["allreduce_ float32[8]", "broadcast_ float32[8]"], answers[rank]
        assert values == [3.0] * 8


@pytest.mark.slow
def test_an_extra_collective_on_one_rank_raises_on_every_rank() -> None:
    answers = run_two_ranks("mismatched")
    for rank in (0, 1):
        assert answers[rank].startswith("CollectiveMismatchError"), answers[rank]
        assert "train_step" in answers[rank] and "1 more collective(s)" in answers[rank]
        assert f"this is rank {rank}" in answers[rank]


@pytest.mark.slow
def test_a_different_size_is_named() -> None:
    answers = run_two_ranks("resized")
    for rank in (0, 1):
        assert (
            "collective 0 is 'allreduce_ float32[512]', rank 0 has 'allreduce_ float32[1024]'"
            in answers[rank]
        )


@pytest.mark.slow
def test_the_pass_through_runs_collectives_eagerly_under_gloo() -> None:
    answers = run_two_ranks("pass_through")
    for rank in (0, 1):
        # ranks 0 and 1 send 2k and 2(1 + k): the sum 4k + 2, plus one.
        assert answers[rank] == [[4.0 * k + 3.0] * 4 for k in range(3)], answers[rank]


@pytest.mark.slow
def test_train_step_over_ddp_matches_plain_ddp_training_under_gloo() -> None:
    answers = run_two_ranks("ddp_train_step")
    for rank in (0, 1):
        assert answers[rank] == (True, True), answers[rank]


@pytest.mark.slow
def test_train_step_over_fsdp2_matches_plain_fsdp2_training_under_gloo() -> None:
    answers = run_two_ranks("fsdp_train_step")
    for rank in (0, 1):
        equal, shards = answers[rank]
        assert equal, answers[rank]
        assert shards == [8, 8, 1, 1], shards  # each rank holds half the rows of each


@pytest.mark.slow
def test_the_tensor_parallel_block_equals_the_single_device_block() -> None:
    answers = run_two_ranks("tensor_parallel")
    for rank in (0, 1):
        assert isinstance(answers[rank], float) and answers[rank] < 1e-4, answers[rank]
