"""Which recorded activations are still intact, for graphed autograd stages in one pool."""

from __future__ import annotations

from ..errors import StaleGraphError, explain

__all__ = ["ActivationOrder"]


class ActivationOrder:
    """Which recorded activations are still intact, for the stages of one shared pool.

    A forward replay of stage ``i`` overwrites the activations its backward reads; in a shared
    pool it may also overwrite those of the stages captured after it. So the backward of a
    forward is valid only if, since that forward, no forward of it or of an earlier stage ran,
    and no later stage's backward is still due (its activations share memory with this backward).
    """

    def __init__(self, n: int):
        self.count = 0
        self.forwarded = [0] * n
        self.pending: dict[int, int] = {}

    def forward(self, stage: int, *, expects_backward: bool) -> int:
        self.count += 1
        self.forwarded[stage] = self.count
        if expects_backward:
            self.pending[stage] = self.count
        return self.count

    def backward(self, stage: int, token: int, name: str) -> None:
        later_forward = self.forwarded[stage] != token or any(
            self.forwarded[j] > token for j in range(stage)
        )
        later_backward_due = any(j > stage and t > token for j, t in self.pending.items())
        if later_forward or later_backward_due:
            raise StaleGraphError(
                explain(
                    f"backward through the graphed {name} after its activations were overwritten",
                    "the forward graph's recorded activations live at fixed addresses; another "
                    "forward replay (a second micro-batch, or an earlier stage of the chain) ran "
                    "since this output was computed"
                    + (", or a later stage's backward is still due" if later_backward_due else ""),
                    "call backward after each forward (forward, backward, forward, backward), "
                    "as gradient accumulation normally does",
                )
            )
        self.pending.pop(stage, None)
