"""The modes a call runs under, which a recording freezes.

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

The check is one call into the compiled extension (``_before_replay.settings_hold``) that reads
PyTorch's global-state guard (the one torch.compile checks before running compiled code), the
inference-mode flag, and the backend settings that guard leaves out but that choose the recorded
kernels or their precision: TF32 in cuDNN's convolutions and recurrent layers, cuDNN on or off and
deterministic, fp16 accumulation in cuBLAS (``compat.backend_settings``). Each is a getter without
arguments; where a program mixed the legacy and the per-operation TF32 flags (the combined getter
then raises), the per-operation precisions are read instead, at a few hundred ns more per call.
Without the extension the same getters are called from Python.

Gradients are separate: a replay records no autograd history, so a capture whose outputs would
carry a gradient path, and a call that could give eager's outputs one (grad mode switched on, a
tensor that now requires grad), is refused with :class:`~cudagraphs.errors.GradientsNotRecordedError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import GradientsNotRecordedError, ModeMismatchError, explain
from . import compat
from .guards import compiled_module
from .signature import same_value

__all__ = [
    "Modes",
    "describe_modes",
    "math_settings",
    "needs_gradients",
    "newly_requiring_grad",
    "outputs_needing_gradients",
    "refuse_gradients",
]


def _settings_hold(calls: tuple[tuple[Callable[..., Any], tuple[Any, ...], Any], ...]) -> bool:
    """The compiled ``settings_hold`` in Python (no compiled extension)."""
    for getter, args, value in calls:
        try:
            now = getter(*args)
        except RuntimeError:
            return False
        if not same_value(now, value):
            return False
    return True


_AUTOCAST_DEVICES = ("cuda", "cpu")


def describe_modes() -> dict[str, Any]:
    """The current modes, in words a message can show."""
    modes: dict[str, Any] = {
        "grad mode": "on" if torch.is_grad_enabled() else "off",
        "inference mode": "on" if torch.is_inference_mode_enabled() else "off",
    }
    for device in _AUTOCAST_DEVICES:
        on = torch.is_autocast_enabled(device)
        modes[f"autocast({device})"] = (
            str(torch.get_autocast_dtype(device)).replace("torch.", "") if on else "off"
        )
    modes["default dtype"] = str(torch.get_default_dtype()).replace("torch.", "")
    modes["deterministic algorithms"] = torch.are_deterministic_algorithms_enabled()
    modes["torch function mode"] = compat.torch_function_enabled()
    modes.update(math_settings())
    return modes


def math_settings() -> dict[str, Any]:
    """The settings that choose kernels' precision and algorithms (TF32 in matmuls and cuDNN,
    reduced-precision reductions, cuDNN on and deterministic, fp16 accumulation, the float32
    precisions), in words; readable also where a program mixed the legacy and the
    per-operation TF32 flags (PyTorch's combined getters raise then). What a key for saved
    compiled code includes."""
    mixed = "mixed (see the float32 precisions)"
    matmul = torch.backends.cuda.matmul
    settings: dict[str, Any] = {}
    try:
        settings["TF32 matmuls"] = "allowed" if matmul.allow_tf32 else "not allowed"
    except RuntimeError:
        settings["TF32 matmuls"] = mixed
    settings["fp16 reduced-precision reductions"] = matmul.allow_fp16_reduced_precision_reduction
    settings["bf16 reduced-precision reductions"] = matmul.allow_bf16_reduced_precision_reduction
    for words, getter, args in (*compat.backend_settings(), *compat.float32_precisions()):
        try:
            settings[words] = getter(*args)
        except RuntimeError:
            settings[words] = mixed
    return settings


class Modes:
    """The modes at capture; :meth:`same` is the per-call check, :meth:`refuse` the message.

    ``same()`` is one call into the compiled extension (PyTorch's global-state guard, the
    inference-mode flag and each backend setting read in C). When the check reports a change
    that does not touch the kernels (the CPU thread count), ``refuse`` takes the new state as
    the reference and lets the call through.
    """

    def __init__(self, name: str):
        self.name = name
        self._take()

    def _take(self) -> None:
        self.guard = compat.global_state_guard()
        calls: list[tuple[Callable[..., Any], tuple[Any, ...], Any]] = [
            (self.guard.check, (), True),
            (torch.is_inference_mode_enabled, (), torch.is_inference_mode_enabled()),
        ]
        for _, getter, args in compat.backend_settings():
            try:
                calls.append((getter, args, getter(*args)))
            except RuntimeError:  # TF32 flags mixed: read the per-operation ones (slower)
                calls.extend((g, a, g(*a)) for _, g, a in compat.float32_precisions())
        self.calls = tuple(calls)
        compiled = compiled_module()
        check = compiled.settings_hold if compiled is not None else _settings_hold
        #: The per-call check: True while every mode and setting is as at capture.
        self.same: Callable[[], bool] = functools.partial(check, self.calls)
        self.seen = describe_modes()

    def refuse(self, sources: Iterable[torch.Tensor] = ()) -> None:
        """Raise the precise error for a call whose modes differ from the capture's; return
        (after taking the new state as reference) when nothing that matters changed."""
        now = describe_modes()
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
