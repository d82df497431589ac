"""Naming a failed capture: the kind of failure in a word, what happened, and the fix."""

from __future__ import annotations

from typing import Any

__all__ = ["LIBRARY_SETTING", "block_hint", "classify_failure", "library_setting"]


# Ordered: the first pattern found in the error chain (primary error first) decides the kind.
_FAILURES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (
        "nested-capture",
        ("captures_underway", "already capturing", "cudagraph trees", "cudagraphify"),
        "the function itself starts a CUDA graph capture (for example a torch.compile "
        "model with mode='reduce-overhead', which records its own graphs)",
        "compile with mode='default' or mode='max-autotune-no-cudagraphs' and let cudagraphs "
        "do the capture",
    ),
    (
        "cpu-tensor",
        ("cannot copy between cpu and cuda", "pinned", "expected all tensors to be on the same"),
        "a CPU tensor was used inside the captured region (a host-to-device copy, or a CPU "
        "tensor mixed into a CUDA op); its value would be frozen at capture",
        "create the tensor on the GPU once, outside the function, and pass it in as an input "
        "(or keep it as a module buffer); a step that must stay as it is can run eagerly "
        "between two graphs: mark its function with @cg.eager, or pass eager=[ItsModule]",
    ),
    (
        "host-sync",
        (
            "operation not permitted when stream is capturing",
            "cudaerrorstreamcaptureunsupported",
            "not supported during cuda graph capture",
            "synchroniz",
        ),
        "the function synchronized with the host while being recorded: .item(), .tolist(), "
        ".cpu(), .numpy(), print(tensor), `if tensor:`, torch.cuda.synchronize(), or an op "
        "whose output shape depends on data (nonzero, boolean-mask indexing, unique)",
        "keep values on the GPU: torch.where(cond, a, b) instead of `if`, fixed-size masks "
        "instead of boolean indexing, and move logging/.item() outside the graphed function "
        "(cg.doctor(fn, *args) lists each such line); or let that step run eagerly between "
        "two graphs: mark its function with @cg.eager, or pass eager=[ItsModule]",
    ),
    (
        "default-stream",
        ("cudaerrorstreamcaptureimplicit", "legacy stream", "implicit"),
        "work was sent to the legacy default stream while another stream was capturing",
        "run all work of the function on the current stream; avoid torch.cuda.default_stream()",
    ),
    (
        "out-of-memory",
        ("out of memory",),
        "the GPU ran out of memory while recording",
        "free memory before capture, use a smaller example, or share a pool between graphs",
    ),
    (
        "illegal-access",
        ("illegal memory access", "misaligned address", "device-side assert"),
        "a kernel faulted; CUDA errors of this kind poison the whole process",
        "run the function eagerly with CUDA_LAUNCH_BLOCKING=1 to find the faulting kernel, "
        "then restart the process",
    ),
    (
        "invalidated",
        ("cudaerrorstreamcaptureinvalidated", "capture invalidated", "invalidated"),
        "an earlier operation invalidated the capture (often a host sync or a CPU copy)",
        "run cg.doctor(fn, *args) to find the operation that cannot be recorded",
    ),
)


def classify_failure(
    error: BaseException, end_error: BaseException | None = None
) -> tuple[str, str, str]:
    """Name a capture failure: ``(kind, what happened in plain words, how to fix it)``."""
    texts = []
    seen: BaseException | None = error
    while seen is not None and len(texts) < 8:
        texts.append(f"{type(seen).__name__}: {seen}".lower())
        seen = seen.__cause__ or seen.__context__
    if end_error is not None:
        texts.append(str(end_error).lower())
    for text in texts:
        for kind, needles, what, fix in _FAILURES:
            if any(needle in text for needle in needles):
                return kind, what, fix
    return (
        "error",
        "the function raised while being recorded, although it ran eagerly during warm-up "
        "(does it behave differently while torch.cuda.is_current_stream_capturing()?)",
        "fix the error shown below, or pass fallback='eager' to run this function eagerly",
    )


def block_hint(module: Any) -> str:
    """Name the block the failure happened in, for ``eager=[...]`` (and a library setting that
    removes the host read, where one is known)."""
    if module is None:
        return ""
    name = type(module).__name__
    hint = f". The step is inside {name}: eager=[{name}] runs that block eagerly"
    if type(module).__module__.startswith("transformers.") and _is_moe(name):
        hint += "; or " + LIBRARY_SETTING
    return hint


#: The known library setting that removes a host read (transformers' MoE experts).
LIBRARY_SETTING = (
    "remove the host read so the whole model is one graph: bf16 weights (native grouped "
    "matmul), or transformers' experts_implementation='batched_mm' "
    "(config._experts_implementation), which copies an expert's weights for every token and "
    "choice and so can be slower than eager with many tokens per call: time it"
)


def _is_moe(text: str) -> bool:
    text = text.lower()
    return "experts" in text or "moe" in text


def library_setting(location: str) -> str | None:
    """The setting that removes a break at ``location`` (a ``file:line``, or a block's name),
    where one is known: a host read inside transformers' mixture-of-experts code."""
    if "transformers" in location and _is_moe(location):
        return LIBRARY_SETTING
    return None
