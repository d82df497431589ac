"""Loops and branches on the device: ``cg.while_loop`` and ``cg.cond`` (CUDA conditional nodes)."""
