"""Sharded training (FSDP2, ``fully_shard``) captured whole, with NCCL and one rank on one GPU:
50 graphed steps against eager FSDP2 from the same weights, both ``reshard_after_forward``
settings, mixed precision and clipping across shards; CPU offload refused; the torchrun
example. Two ranks need two GPUs (``benchmarks/distributed.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from test_train_cuda import make_step
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

import cudagraphs as cg

pytestmark = pytest.mark.cuda

STEPS = 50
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def nccl_group() -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(reshard: bool, bf16: bool, **extra: object) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(4)], nn.Linear(128, 10)
    ).cuda()
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for layer in model:
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=policy, **extra)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy, **extra)
    return model


@pytest.mark.parametrize(
    ("reshard", "bf16", "clip"),
    [(True, False, True), (False, False, True), (True, True, True), (False, True, False)],
    ids=["reshard-fp32-clip", "keep-fp32-clip", "reshard-bf16-clip", "keep-bf16"],
)
def test_a_sharded_step_in_one_graph_trains_as_eager_fsdp2(
    nccl_group: None, reshard: bool, bf16: bool, clip: bool
) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    data = [
        (torch.randn(32, 128, device="cuda", generator=g), torch.randint(0, 10, (32,), device="cuda", generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip
    reference, model = sharded(reshard, bf16), sharded(reshard, bf16)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    eager, step = (
        make_step(reference, ref_opt, clip),
        cg.train_step(make_step(model, opt, clip), optimizer=opt),
    )
    for x, y in data:
        expected = eager(x, y)
        loss = step(x, y)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert step.state is cg.State.CAPTURED and step.stats.replays == STEPS - step.warmup
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-7, msg=name)


def test_a_sharded_model_moved_after_capture_is_captured_again(nccl_group: None) -> None:
    """``model.to(dtype)`` swaps each DTensor's shard under the same parameter object: the
    graph would read the old shards' memory. The guard sees the new shard and captures again."""
    model = sharded(True, False)
    opt = cg.GraphSafeSGD(model.parameters(), lr=0.1, momentum=0.9)
    step = cg.train_step(make_step(model, opt, False), optimizer=opt, warmup=2)
    x, y = torch.randn(32, 128, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    for _ in range(4):
        step(x, y)
    assert step.state is cg.State.CAPTURED
    first = model[0][0].weight
    with torch.no_grad():
        model.to(torch.float64).to(torch.float32)  # the same DTensors, new shards
    assert model[0][0].weight is first
    assert step.guard is not None and "holds another shard" in (step.guard.stale() or "")
    before = [p.full_tensor().clone() for p in model.parameters()]
    step(x, y)  # captured again on the new shards, which it trains
    assert step.stats.recaptures == 1
    assert all(not torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before))


def test_cpu_offload_is_refused_with_the_fix(nccl_group: None) -> None:
    model = sharded(True, False, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = cg.train_step(make_step(model, opt, False), optimizer=opt)
    x, y = torch.randn(32, 128, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    with pytest.raises(cg.ConfigError, match="CPUOffloadPolicy") as raised:
        step(x, y)
    assert "drop offload_policy" in str(raised.value)


def test_the_fsdp_example_runs_under_torchrun_with_one_rank() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
         "--master-port", str(free_port()), str(ROOT / "examples" / "fsdp_train.py"), "--steps", "20"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "max relative difference" in done.stdout
