"""Loops and branches on the device: ``cg.while_loop`` and ``cg.cond`` (CUDA conditional nodes)."""

from .flow import cond, while_loop

__all__ = ["cond", "while_loop"]
