"""Data-parallel training steps, on the CPU: a DDP model in cg.train_step must have been built
on the capture stream and gets PyTorch's 11 warm-up steps; a replay that never finishes raises,
naming the graph, within its timeout."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import cudagraphs as cg
from cudagraphs.core.replay import wait_for_replay
from cudagraphs.training.distributed import DDP_WARMUP, checked_warmup


def test_a_ddp_model_not_built_on_the_capture_stream_is_refused(gloo_group: None) -> None:
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    with pytest.raises(cg.ConfigError, match=r"cg\.ddp\(module") as raised:
        checked_warmup(step, (), warmup=3, warmup_given=False, stream=None)
    assert "AccumulateGrad" in str(raised.value) and "stream=s" in str(raised.value)


def test_ddp_steps_warm_up_eleven_times_unless_told_fewer(gloo_group: None) -> None:
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    model.cudagraphs_capture_stream = object()  # as cg.ddp marks it (no CUDA here)

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    assert checked_warmup(step, (), warmup=3, warmup_given=False, stream=None) == DDP_WARMUP
    assert checked_warmup(step, (), warmup=20, warmup_given=True, stream=None) == 20
    with pytest.raises(cg.ConfigError, match="at least 11 eager DDP iterations"):
        checked_warmup(step, (), warmup=3, warmup_given=True, stream=None)


def test_a_step_without_ddp_keeps_its_warmup() -> None:
    model = nn.Linear(4, 2)
    assert checked_warmup(lambda x: model(x), (), warmup=2, warmup_given=True, stream=None) == 2


def test_cg_ddp_needs_cuda_parameters(gloo_group: None) -> None:
    with pytest.raises(cg.ConfigError, match=r"CUDA (GPU|device)"):
        cg.ddp(nn.Linear(4, 2))


def test_a_replay_that_never_finishes_raises_within_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(
        cg.ReplayTimeoutError, match=r"the replay of step\(\) did not finish within 0\.2 s"
    ):
        wait_for_replay(0.2, "step()", done=lambda: False, poll_s=0.01)
    assert time.monotonic() - start < 2.0
    wait_for_replay(0.2, "step()", done=lambda: True)  # finished: returns at once


@pytest.mark.parametrize("bad", [0, -1.0, True, "30"])
def test_replay_timeout_must_be_positive_seconds(bad: object) -> None:
    with pytest.raises(cg.ConfigError, match="replay_timeout_s"):
        cg.graph(lambda x: x + 1, torch.zeros(2), replay_timeout_s=bad)
