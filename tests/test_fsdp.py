"""Sharded models (FSDP2, ``fully_shard``) on the CPU with gloo and one rank: the guard reads a
DTensor through its shard (the address and which shard its slot holds), a step over a model
offloaded to the host is refused, and ``cg.train_step`` without CUDA trains as eager. The
captured path is tested with NCCL on the GPU (``test_fsdp_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import cudagraphs as cg
from cudagraphs.core import compat
from cudagraphs.core.guards import AddressGuard
from cudagraphs.training.distributed import checked_sharding
from cudagraphs.training.optimizers import make_graph_safe


def sharded() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def test_the_guard_sees_a_shard_swapped_under_the_same_dtensor(gloo_group: None) -> None:
    model = sharded()
    guard = AddressGuard(lambda x: model(x), [model])
    weight = model[0].weight
    assert isinstance(weight, DTensor) and guard.stale() is None
    model.double()  # swaps each DTensor's shard; the old shard stays alive at its address
    assert model[0].weight is weight
    assert "Sequential.0.weight holds another shard now" in (guard.stale() or "")


def test_the_guard_sees_a_shard_moved_to_new_memory(gloo_group: None) -> None:
    model = sharded()
    guard = AddressGuard(lambda x: model(x), [model])
    found = compat.tensor_shard(model[2].bias)
    assert found is not None
    with torch.no_grad():
        found[1].set_(torch.randn(4))  # the same shard object, other memory
    assert "Sequential.2.bias (its shard) now lives at new memory" in (guard.stale() or "")


def test_a_plain_tensor_has_no_shard() -> None:
    assert compat.tensor_shard(torch.ones(2)) is None


def test_a_model_offloaded_to_the_host_is_refused(
    gloo_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = sharded()
    checked_sharding(lambda x: model(x), [model])  # shards on the mesh's own device: fine
    # As fully_shard(..., offload_policy=CPUOffloadPolicy()) leaves them on a GPU mesh.
    mesh = model[0].weight.device_mesh
    monkeypatch.setattr(type(mesh), "device_type", property(lambda self: "cuda"))
    with pytest.raises(
        cg.ConfigError, match=r"Sequential\.0 is sharded .*CPUOffloadPolicy"
    ) as raised:
        checked_sharding(lambda x: model(x), [model])
    assert "drop offload_policy" in str(raised.value)


def test_train_step_without_cuda_trains_a_sharded_model_as_eager(gloo_group: None) -> None:
    model = sharded()
    reference = sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def make(m: nn.Module, o: torch.optim.Optimizer):
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            return loss

        return step

    step, eager = cg.train_step(make(model, opt), optimizer=opt), make(reference, ref_opt)
    for _ in range(5):
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        torch.testing.assert_close(step(x, y), eager(x, y).detach(), rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0)


def test_sgd_over_sharded_parameters_is_refused_naming_graph_safe_sgd(gloo_group: None) -> None:
    """Its fused form, the one make_graph_safe would switch to, has no DTensor rule."""
    model = sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(cg.ConfigError, match="sharded parameters") as raised:
        make_graph_safe(opt)
    assert "cg.GraphSafeSGD" in str(raised.value) and opt.param_groups[0]["fused"] is None
    plain = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(cg.ConfigError, match="CUDA") as raised:  # not refused for sharding
        make_graph_safe(plain)
    assert "sharded" not in str(raised.value)


def test_graph_safe_sgd_steps_a_sharded_model(gloo_group: None) -> None:
    model, reference = sharded(), sharded()
    opt = cg.GraphSafeSGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(16, 8)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor())


def test_sgd_over_a_group_sharded_only_past_its_first_parameter_is_refused(
    gloo_group: None,
) -> None:
    """Only the second layer sharded: the group's first parameter is a plain tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model[2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert compat.tensor_shard(next(model.parameters())) is None
    with pytest.raises(cg.ConfigError, match="sharded parameters"):
        make_graph_safe(opt)


def test_offload_is_refused_for_a_sharded_submodule_alone(
    gloo_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root is a plain module; only a layer inside it is sharded (and offloaded)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model[2])
    mesh = model[2].weight.device_mesh
    monkeypatch.setattr(type(mesh), "device_type", property(lambda self: "cuda"))
    with pytest.raises(cg.ConfigError, match=r"Sequential\.2 is sharded"):
        checked_sharding(lambda x: model(x), [model])
