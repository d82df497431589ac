"""RL rollout: a small policy network and a toy physics environment, 16 steps captured whole.

An RL rollout loop: small networks called thousands of times. The state lives in a dict
that the rollout updates in place; cudagraphs copies the in-place update back into the caller's
tensors, exactly as eager would. Sampling noise is drawn inside the graph and differs on every
replay. Runs on a GPU; on a CPU-only machine it runs the eager pass-through.

    python examples/rl_rollout.py
"""

import time

import torch
from torch import nn

import cudagraphs as cg

device = "cuda" if torch.cuda.is_available() else "cpu"
N_ENVS, OBS, ACT, STEPS = 256, 8, 2, 16

policy = nn.Sequential(nn.Linear(OBS, 64), nn.Tanh(), nn.Linear(64, ACT)).to(device).eval()


def rollout(state: dict) -> torch.Tensor:
    """Advance every environment STEPS steps; return the summed reward per environment."""
    pos, vel = state["pos"], state["vel"]
    total = torch.zeros(N_ENVS, device=pos.device)
    for _ in range(STEPS):
        obs = torch.cat([pos, vel, pos * vel, torch.sin(pos)], dim=-1)
        action = torch.tanh(policy(obs) + 0.1 * torch.randn_like(vel))
        vel.mul_(0.95).add_(0.05 * action)  # in place: the caller's state advances
        pos.add_(vel)
        total += -(pos**2).sum(-1)
    return total


def fresh_state() -> dict:
    return {
        "pos": torch.randn(N_ENVS, ACT, device=device),
        "vel": torch.zeros(N_ENVS, ACT, device=device),
    }


with torch.no_grad():
    graphed = cg.graph(rollout, fresh_state())

    state = fresh_state()
    eager_state = {k: v.clone() for k, v in state.items()}
    torch.manual_seed(0)
    reward = graphed(state)
    print("mean reward over", STEPS, "steps:", reward.mean().item())
    print("state advanced in place:", not torch.equal(state["pos"], eager_state["pos"]))

    label = "graphed" if graphed.state is cg.State.CAPTURED else "cg.graph, eager (no CUDA)"
    for name, fn in [("eager", rollout), (label, graphed)]:
        s = fresh_state()
        fn(s)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            fn(s)
        if device == "cuda":
            torch.cuda.synchronize()
        print(
            f"{name:8s} {(time.perf_counter() - start) / 50 * 1e3:.3f} ms per {STEPS}-step rollout"
        )
