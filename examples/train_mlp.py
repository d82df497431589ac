"""Training with CUDA graphs, two ways: the whole step as one graph, or graphed modules.

A custom training loop: a fixed-shape training step. ``cg.train_step`` captures forward, loss,
backward, gradient clipping and the optimizer step as one graph (the optimizer is switched to
its fused form and the learning rate lives on the GPU, so the scheduler keeps working). The
first three steps run eagerly (they are real steps), then every step is one graph launch.

``cg.graph_autograd`` graphs only a module's forward and backward, for loops that must stay
eager around it (gradient accumulation, a custom optimizer); gradients accumulate correctly.

Runs on a GPU; without one, the whole-step version runs eagerly and the graphed module is skipped.

    python examples/train_mlp.py
"""

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import cudagraphs as cg

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 16)).to(
    device
)
reference = copy.deepcopy(model)  # trained eagerly, for comparison
data = [
    (torch.randn(256, 256, device=device), torch.randint(0, 16, (256,), device=device))
    for _ in range(8)
]


def make_step(net: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()  # at capture: grads None, so backward allocates them in the graph's pool
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        return loss

    return step


opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
step = cg.train_step(make_step(model, opt), optimizer=opt)

ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=200)
ref_step = make_step(reference, ref_opt)

# Dropout draws differ between the two models' RNG use, so compare with dropout off first...
model.eval(), reference.eval()
for x, y in data[:5]:
    loss = step(x, y)
    ref_loss = ref_step(x, y)
    sched.step(), ref_sched.step()
label = "graphed" if step.state is cg.State.CAPTURED else "cg.train_step, eager (no CUDA),"
print(f"after 5 steps: {label} loss {loss.item():.5f}, eager loss {ref_loss.item():.5f}")
drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
print(f"max parameter difference from eager training: {drift:.2e}")

# ...then train with dropout on: a switch of mode is noticed and the step captured again.
model.train()
if device == "cuda":
    torch.cuda.synchronize()
start = time.perf_counter()
for i in range(200):
    x, y = data[i % len(data)]
    loss = step(x, y)
    sched.step()
if device == "cuda":
    torch.cuda.synchronize()
elapsed = time.perf_counter() - start
print(
    f"200 steps in {elapsed * 1e3:.1f} ms ({200 / elapsed:.0f} steps/s); final loss {loss.item():.4f}"
)
print(step.stats)

if device == "cuda":
    # Graphed forward+backward inside an eager loop with gradient accumulation.
    block = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(device)
    head = nn.Linear(256, 16).to(device)
    eager_block = copy.deepcopy(block)
    block = cg.graph_autograd(block, torch.randn(64, 256, device=device))
    x, y = data[0]
    for net in (block, eager_block):
        for micro_x, micro_y in zip(x.chunk(4), y.chunk(4)):
            (F.cross_entropy(head(net(micro_x)), micro_y) / 4).backward()
    diff = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(block.parameters(), eager_block.parameters())
    )
    print(
        f"graph_autograd: gradients accumulated over 4 micro-batches differ from eager by {diff:.2e}"
    )
else:
    print("graph_autograd needs CUDA; skipped on this machine")
