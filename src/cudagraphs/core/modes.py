"""The modes a call runs under, which a recording freezes: part of what every call is checked
against.

A CUDA graph records the kernels that the function launched at capture. Those depend on more
than the tensors: under ``torch.autocast`` a matmul is a bf16 kernel, under ``torch.no_grad()``
some modules take a fused inference path, with TF32 allowed cuBLAS picks other kernels. A replay
under other modes would hand back what eager would not (an fp32 result inside a bf16 autocast
region), so each replay first checks that the modes are those of the capture.

Right::

    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        g = cg.graph(model, x)       # captured under bf16 autocast
        y = g(x)                     # the same modes: replays

Wrong::

    with torch.no_grad():
        g = cg.graph(model, x)       # captured in fp32
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        g(x)                         # ModeMismatchError: autocast(cuda) was off, is bfloat16

The check is one C call (PyTorch's global-state guard, the one torch.compile checks before
running compiled code) plus the inference-mode flag. Gradients are separate: a replay records no
autograd history, so a capture whose outputs would carry a gradient path, and a call that could
give eager's outputs one (grad mode switched on, a tensor that now requires grad), is refused
with :class:`~cudagraphs.errors.GradientsNotRecordedError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import GradientsNotRecordedError, ModeMismatchError, explain
from . import compat

__all__ = ["Modes", "describe", "needs_gradients", "outputs_needing_gradients", "refuse_gradients"]

_AUTOCAST_DEVICES = ("cuda", "cpu")


def describe() -> dict[str, Any]:
    """The current modes, in words a message can show (public torch APIs only)."""
    modes: dict[str, Any] = {
        "grad mode": "on" if torch.is_grad_enabled() else "off",
        "inference mode": "on" if torch.is_inference_mode_enabled() else "off",
    }
    for device in _AUTOCAST_DEVICES:
        on = torch.is_autocast_enabled(device)
        modes[f"autocast({device})"] = (
            str(torch.get_autocast_dtype(device)).replace("torch.", "") if on else "off"
        )
    matmul = torch.backends.cuda.matmul
    modes["TF32 matmuls"] = "allowed" if matmul.allow_tf32 else "not allowed"
    modes["fp16 reduced-precision reductions"] = matmul.allow_fp16_reduced_precision_reduction
    modes["bf16 reduced-precision reductions"] = matmul.allow_bf16_reduced_precision_reduction
    modes["default dtype"] = str(torch.get_default_dtype()).replace("torch.", "")
    modes["deterministic algorithms"] = torch.are_deterministic_algorithms_enabled()
    modes["torch function mode"] = compat.torch_function_enabled()
    return modes


class Modes:
    """The modes at capture; :meth:`same` is the per-call check, :meth:`refuse` the message.

    ``same()`` costs one C call and one flag read (about 0.2 µs on a slow host). When the C
    check reports a change that does not touch the kernels (the CPU thread count), ``refuse``
    takes the new state as the reference and lets the call through.
    """

    def __init__(self, name: str):
        self.name = name
        self._take()

    def _take(self) -> None:
        self.guard = compat.global_state_guard()
        self.inference = torch.is_inference_mode_enabled()
        self.seen = describe()

    def same(self) -> bool:
        return self.guard.check() and torch.is_inference_mode_enabled() is self.inference

    def refuse(self, sources: Iterable[torch.Tensor] = ()) -> None:
        """Raise the precise error for a call whose modes differ from the capture's; return
        (after taking the new state as reference) when nothing that matters changed."""
        now = describe()
        changed = [(k, v, now[k]) for k, v in self.seen.items() if now.get(k) != v]
        if not changed:
            self._take()  # e.g. torch.set_num_threads: not part of a CUDA recording
            return
        if now["grad mode"] == "on" and (why := needs_gradients(sources)) is not None:
            raise GradientsNotRecordedError(_gradients_message(self.name, why))
        what = "; ".join(f"{k} was {was} at capture, is {is_} now" for k, was, is_ in changed)
        per_thread = any(k in ("grad mode", "inference mode") for k, _, _ in changed)
        threads = (
            " (grad and inference mode are per thread: a worker thread starts with grad mode "
            "on, so enter torch.inference_mode() or torch.no_grad() in the thread that calls)"
            if per_thread
            else ""
        )
        raise ModeMismatchError(
            explain(
                f"{self.name} is called under other modes than it was captured under: {what}",
                "the recording holds the kernels those modes chose at capture (dtypes, fused "
                "paths, math settings); replaying it would not give eager's answer",
                "call it under the modes it was captured under, or capture one graph per mode: "
                f"create (and first call) each graph inside the `with` block it is used in{threads}",
            )
        )


def needs_gradients(tensors: Iterable[torch.Tensor]) -> str | None:
    """Under grad mode: which of ``tensors`` (inputs, parameters, closure tensors) requires
    grad, so that eager would record autograd history; ``None`` if none does or grad is off."""
    if not torch.is_grad_enabled():
        return None
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return _tensor_words(t)
    return None


def outputs_needing_gradients(output: Any) -> str | None:
    """Which output of an eager run carries a gradient path (``None``: none does)."""
    import optree

    for t in optree.tree_leaves(output, namespace="cudagraphs"):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return f"its output of shape {tuple(t.shape)} requires grad"
    return None


def newly_requiring_grad(tensors: Sequence[Any], at_capture: Sequence[bool]) -> str | None:
    """Under grad mode: a tensor that requires grad now but did not at capture (eager's
    outputs may now carry a gradient path); ``None`` if there is none."""
    for t, before in zip(tensors, at_capture):
        if not before and isinstance(t, torch.Tensor) and t.requires_grad:
            return _tensor_words(t) + " (it did not at capture)"
    return None


def refuse_gradients(name: str, why: str) -> None:
    raise GradientsNotRecordedError(_gradients_message(name, why))


def _tensor_words(t: torch.Tensor) -> str:
    return f"a tensor of shape {tuple(t.shape)} requires grad"


def _gradients_message(name: str, why: str) -> str:
    return explain(
        f"{name} is called with gradients enabled and {why}",
        "a graph replay records no autograd history, so eager's output would carry a gradient "
        "path and the replay's would silently not",
        "for inference call it under torch.no_grad() or torch.inference_mode(); for training "
        "graph forward and backward with cg.graph_autograd(module, x), or the whole step with "
        "cg.train_step",
    )
