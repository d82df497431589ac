"""The core: signature, warm-up and capture, the one replay path, outputs, guards, state.

Nothing here imports the diagnostics, the shapes layer, training or the tools.
"""
