"""An RL rollout that runs until every environment is done, in one graph launch.

The loop's condition ("is any environment still running?") is a tensor on the GPU: inside
cg.graph, cg.while_loop becomes a CUDA conditional node, so a replay steps the environments
until all are done (at most max_iterations times) with no round-trip to the host. Without CUDA
(or run eagerly) the same code is a Python loop with the same result.

    python examples/rollout_until_done.py
"""

from __future__ import annotations

import time

import torch

import cudagraphs as cg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENVS = 1024


def rollout(position: torch.Tensor, velocity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Point masses move right, slowing down, until each passes x = 10."""

    def running(p: torch.Tensor, v: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return (p < 10).any()

    def step(p: torch.Tensor, v: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        moving = p < 10
        return p + v * moving, v * 0.999, steps + moving.to(torch.int32)

    steps = torch.zeros(position.shape, dtype=torch.int32, device=position.device)
    p, _, steps = cg.while_loop(running, step, (position, velocity, steps), max_iterations=1000)
    return p, steps


def main() -> None:
    torch.manual_seed(0)
    position = torch.rand(ENVS, device=DEVICE) * 5
    velocity = torch.rand(ENVS, device=DEVICE) * 0.5 + 0.05
    graphed = cg.graph(rollout, position, velocity)
    _, eager_steps = rollout(position, velocity)
    _, steps = graphed(position, velocity)
    print(f"episode lengths equal eager: {torch.equal(steps, eager_steps)}; "
          f"longest {int(steps.max())} steps")  # fmt: skip
    label = "cg.graph (one launch)" if graphed.state is cg.State.CAPTURED else "eager (no CUDA)"
    for name, fn in (("eager (Python loop)", rollout), (label, graphed)):
        fn(position, velocity)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn(position, velocity)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        print(f"{name:22s} {1e3 * (time.perf_counter() - start) / 5:8.2f} ms per rollout")


if __name__ == "__main__":
    main()
