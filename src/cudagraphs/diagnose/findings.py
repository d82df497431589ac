"""What the doctor reports: the kinds of finding, one finding at the user's line, the report.

Each kind has a severity ("error" breaks capture, "wrong" gives silently wrong replays,
"warning" needs care), a one-line explanation and the fix. The collector places a finding at
the first frame outside torch and cudagraphs, and keeps one per (kind, line).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core import current_eager_step, user_frame

__all__ = ["KINDS", "Collector", "Finding", "Report"]

#: What an eager step (``@cg.eager``) may do: between two graphs it runs for real.
_SPLIT_KINDS = ("host-sync", "dynamic-shape", "cpu-tensor", "control-flow")

#: severity: "info" is a split point; "error" breaks capture, "wrong" gives silently wrong replays, "warning" needs care.
KINDS: dict[str, tuple[str, str, str]] = {
    "split-point": (
        "info",
        "{what} inside the eager step {where}: a split point, run eagerly between two graphs "
        "at every call (not a blocking finding)",
        "nothing to fix; to record this step too, remove its host read and the @cg.eager mark",
    ),
    "host-sync": (
        "error",
        "{what} synchronizes with the host; capture refuses it (or freezes the value it read)",
        "keep the value on the GPU: torch.where(cond, a, b) instead of `if`; move logging, "
        ".item() and printing outside the graphed function",
    ),
    "dynamic-shape": (
        "error",
        "{what} has an output shape that depends on the data; a graph needs static shapes",
        "use fixed-size results: a mask multiply or torch.where instead of boolean indexing, "
        "repeat_interleave(..., output_size=n), padding to a maximum",
    ),
    "cpu-tensor": (
        "wrong",
        "{what} brings CPU data into the region; on CUDA it is a host-to-device copy that is "
        "recorded once, so every replay reuses the value seen at capture",
        "create the tensor on the GPU once, outside the function, and pass it in (or register "
        "it as a module buffer)",
    ),
    "sync-call": (
        "error",
        "{what} is an explicit synchronization, which capture refuses",
        "remove it from the graphed function; synchronize outside if needed",
    ),
    "input-mutation": (
        "warning",
        "{what} writes into input {where} in place; hand-rolled graphs then diverge from eager "
        "(cudagraphs copies the result back to the caller's tensor)",
        "return a new tensor instead, or rely on cudagraphs' write-back",
    ),
    "output-aliases-input": (
        "warning",
        "output {where} is (a view of) input {other}; a graph returns its static buffer, which "
        "the next call's copy-in overwrites",
        "return x.clone(), or use outputs='guarded' (the default) to be told of stale reads",
    ),
    "closure-tensor": (
        "warning",
        "{what} reads tensor {where} by address; it is neither an input nor a parameter or buffer "
        "of the modules involved, so rebinding it after capture is not seen by the graph",
        "pass it as an input, or register it as a module buffer and update it in place",
    ),
    "python-state": (
        "error",
        "{what} changes from one run to the next ({where}): a recording runs the Python code "
        "once, so every replay would repeat the first run's value (capture raises "
        "FrozenStateError)",
        "keep the value in a tensor on the device, updated in place, or move it out of the "
        "graphed function; a counter that decides nothing on the GPU: harmless_state=({name!r},)",
    ),
    "host-random": (
        "error",
        "{what} draws from {where} at every run: a recording bakes in each number drawn on the "
        "host, so every replay would repeat the first run's draw (capture raises "
        "FrozenStateError)",
        "draw on the device with torch (torch.rand((), device=x.device) < p); a draw that "
        "decides nothing on the GPU: harmless_state=({name!r},)",
    ),
    "state-write": (
        "warning",
        "{what} writes {where}, a tensor outside the inputs: every replay repeats this write, as "
        "every eager call does (warm-up's writes are put back by cudagraphs)",
        "nothing to do if this is state the model keeps (a KV cache, running statistics); "
        "otherwise return the new value instead of writing it in place",
    ),
    "optimizer": (
        "error",
        "{what}: optimizer {where} has capturable=False; its step keeps state on the CPU and "
        "cannot be recorded",
        "construct the optimizer with capturable=True (Adam, AdamW, SGD with momentum ...)",
    ),
    "grad-scaler": (
        "error",
        "{what}: GradScaler.step reads found_inf with a host sync to decide whether to step",
        "use bf16 autocast (no scaler), or a fused optimizer that takes grad_scale/found_inf",
    ),
    "autocast-cache": (
        "warning",
        "{what} runs under autocast with cache_enabled=True; cast weights stay cached until the "
        "outermost autocast region ends, so a hand-rolled graph captured inside a region that "
        "encloses the call replays casts made at capture (stale weights, then freed memory). "
        "cudagraphs turns the cache off during its own warm-up and capture",
        "use torch.autocast(..., cache_enabled=False) where you capture by hand",
    ),
    "generator": (
        "wrong",
        "{what} draws from a custom torch.Generator that is not registered with the graph, so "
        "every replay repeats the same numbers",
        "use the default generator, or register it: graph.register_generator_state(gen)",
    ),
    "multi-device": (
        "error",
        "{what} mixes tensors on {where}; one graph records one device",
        "keep the function on one device",
    ),
    "control-flow": (
        "wrong",
        "two runs with inputs of the same shapes took different op sequences here ({what}); the "
        "graph freezes the branch taken at capture",
        "replace the Python branch with tensor ops (torch.where), or pass the deciding value as "
        "a plain argument (then a change is refused at call time)",
    ),
}


@dataclass(frozen=True)
class Finding:
    """One construct that breaks capture or corrupts a graph, at the user's line."""

    kind: str
    severity: str
    filename: str
    lineno: int
    message: str
    fix: str

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.lineno}"


@dataclass
class Report:
    """The doctor's findings; empty on a function that graphs cleanly."""

    function: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def blocking(self) -> bool:
        """Whether a finding breaks capture or would make replays silently wrong."""
        return any(f.severity in ("error", "wrong") for f in self.findings)

    def __bool__(self) -> bool:
        return bool(self.findings)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self.findings]

    def __rich__(self) -> Any:
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=escape(f"cg.doctor: {self.function}: {len(self.findings)} finding(s)"))
        for column in ("kind", "severity", "where", "what", "fix"):
            table.add_column(column, overflow="fold")
        for f in self.findings:
            where = f"{os.path.basename(f.filename)}:{f.lineno}"
            # Findings quote code (`x[mask]`): text, never markup.
            table.add_row(*(escape(t) for t in (f.kind, f.severity, where, f.message, f.fix)))
        return table

    def __str__(self) -> str:
        if not self.findings:
            return f"cg.doctor: {self.function}: no findings"
        lines = [f"cg.doctor: {self.function}: {len(self.findings)} finding(s)"]
        for f in self.findings:
            lines.append(
                f"  [{f.severity}] {f.kind} at {f.location}: {f.message}\n      fix: {f.fix}"
            )
        return "\n".join(lines)


class Collector:
    """Findings of one run, deduplicated by (kind, line), plus the op sequence for comparison."""

    def __init__(self) -> None:
        self.findings: dict[tuple[str, str, int], Finding] = {}
        self.ops: list[tuple[str, tuple[Any, ...], str, int]] = []

    def add(self, kind: str, what: str, where: str = "", other: str = "") -> None:
        step = current_eager_step()
        if step is not None and kind in _SPLIT_KINDS:
            kind, where = "split-point", step
        filename, lineno = user_frame()
        key = (kind, filename, lineno)
        if key in self.findings:
            return
        severity, message, fix = KINDS[kind]
        self.findings[key] = Finding(
            kind,
            severity,
            filename,
            lineno,
            message.format(what=what, where=where, other=other),
            fix,
        )
