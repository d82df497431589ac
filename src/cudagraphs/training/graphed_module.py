"""What ``cg.graph_autograd`` returns for an ``nn.Module``: a stand-in module whose forward is
the graphed one, sharing the original's state.

The user's module is left as it was (its ``forward`` is not replaced). The stand-in holds the
very parameter, buffer and child dicts of the original, so ``state_dict()`` has the same keys,
``parameters()`` are the same objects, ``.to()``, ``zero_grad()`` and ``load_state_dict()`` act
on both, and it can be put where the module was (``model.block = cg.graph_autograd(model.block,
x)``). ``train()`` and ``eval()`` switch both. Other attributes are read from the original,
which is at ``.original``; the :class:`~.autograd.GraphedAutograd` is at ``.graphed``.

Right::

    model.block = cg.graph_autograd(model.block, x)    # the parent now calls the graphed block
    torch.save(model.state_dict(), path)               # the same keys as before

Wrong: ``cg.graph_autograd(model.block, x)`` with the result dropped; ``model.block`` is still
the eager module (nothing of the user's is rewired behind their back).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core import compat
from .autograd import GraphedAutograd

__all__ = ["GraphedModule"]


class GraphedModule(nn.Module):
    """A module whose forward replays ``graphed``, over the state of ``original``."""

    def __init__(self, original: nn.Module, graphed: GraphedAutograd):
        super().__init__()
        compat.share_module_state(self, original)
        # Set past nn.Module.__setattr__, which would register ``original`` as a child in the
        # shared dict of children (that is, inside the original itself).
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "graphed", graphed)
        self.training = original.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.graphed(*args, **kwargs)

    def train(self, mode: bool = True) -> GraphedModule:
        """Switch the stand-in and the original (the graphed autograd reads the original's
        mode: a graph is recorded in one mode)."""
        super().train(mode)
        self.original.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None:
                raise
            return getattr(original, name)

    def extra_repr(self) -> str:
        return f"graphed {type(self.original).__name__}"
