"""Schedules that change more than the learning rate, in a captured training step.

``OneCycleLR`` with ``cycle_momentum=True`` changes AdamW's ``betas[0]`` every step, and
``CyclicLR`` changes SGD's momentum. torch's optimizers read those as Python floats, which a
recording freezes, so ``cg.train_step`` would have to capture the step again after each change
(correct, but no faster than eager). ``cg.GraphSafeAdamW`` and ``cg.GraphSafeSGD`` read them
from device tensors, refreshed before every replay: one capture serves the whole schedule.

Runs on a GPU; without one the steps run eagerly (same code, same results, no graph).

    python examples/schedules.py
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import cudagraphs as cg

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).to(device)
reference = copy.deepcopy(model)  # the same optimizer implementation, stepped eagerly


def make(net: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    opt = cg.GraphSafeAdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=60)
    return opt, sched


def make_step(net: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


opt, sched = make(model)
ref_opt, ref_sched = make(reference)
step = cg.train_step(make_step(model, opt), optimizer=opt)
eager = make_step(reference, ref_opt)
for _ in range(50):
    x, y = torch.randn(32, 64, device=device), torch.randn(32, 8, device=device)
    step(x, y)
    eager(x, y)
    sched.step()
    ref_sched.step()

beta1 = opt.param_groups[0]["betas"][0]
worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
kind = "graph replays" if step.state is cg.State.CAPTURED else "eager steps (no CUDA)"
print(f"50 {kind}; recaptures: {step.stats.recaptures}; betas[0] now {beta1:.4f}")
print(f"largest parameter difference from the eager run: {worst:.2e}")
