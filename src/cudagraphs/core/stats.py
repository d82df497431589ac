"""[stats] Counters and costs of one graphed callable, as a plain snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Costs", "Stats", "snapshot"]


@dataclass
class Costs:
    """What a graphed callable spent outside replays, kept up to date as it goes."""

    eager_calls: int = 0
    warmup_s: float = 0.0
    capture_s: float = 0.0
    pool_bytes: int = 0
    static_input_bytes: int = 0
    recaptures: int = 0
    restored_bytes: int = 0

    def record_capture(self, captured: Any) -> None:
        """Account one capture (``capture.Captured``)."""
        self.warmup_s = captured.warmup_s
        self.restored_bytes += captured.written.nbytes
        self.capture_s = captured.recording.capture_s
        self.pool_bytes = captured.recording.pool_bytes
        self.static_input_bytes = captured.static_input_bytes


@dataclass(frozen=True)
class Stats:
    """What a graphed callable did so far and what its capture cost.

    ``copies_skipped`` counts tensor inputs that needed no copy because the caller passed the
    graph's own buffer (``g(*g.inputs)``); ``writebacks`` counts copies of in-place mutated inputs
    back to the caller's tensors. ``pool_bytes`` is the GPU memory the capture reserved (its
    private pool, or what it added to a shared one). ``recaptures`` counts captures redone because
    a guarded tensor moved; ``guarded_tensors`` is how many addresses are checked per replay, and
    ``guard_check`` how: ``"compiled"`` (a few ns per tensor), ``"torch helper"`` or
    ``"python loop"`` (no C++ compiler found: about 10x slower), ``""`` with no tensor to check.
    ``state_writes`` counts the tensors outside the inputs that the function writes (module
    buffers, a cache: every replay repeats those writes), and ``restored_bytes`` the bytes of
    them that warm-up wrote and that were put back. ``graphs`` and ``gaps`` count the segments
    of the recording and the eager steps between them (``@cg.eager``, ``eager=[...]``), and
    ``gap_s`` is the host time spent in those steps so far (it includes any wait for the GPU
    they make, such as an ``.item()``). ``notices`` counts each warning's cause (a recapture
    for the same reason, running eagerly without CUDA): each was printed once, however often
    it happened.
    """

    state: str
    calls: int = 0
    replays: int = 0
    eager_calls: int = 0
    copies: int = 0
    copies_skipped: int = 0
    writebacks: int = 0
    warmup_s: float = 0.0
    capture_s: float = 0.0
    pool_bytes: int = 0
    static_input_bytes: int = 0
    recaptures: int = 0
    guarded_tensors: int = 0
    guard_check: str = ""
    state_writes: int = 0
    restored_bytes: int = 0
    graphs: int = 0
    gaps: int = 0
    gap_s: float = 0.0
    notices: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def snapshot(
    state: str,
    counters: Any,
    costs: Costs,
    *,
    n_inputs: int,
    guarded: tuple[int, str],
    state_writes: int,
    recording: Any = None,
    notices: dict[str, int] | None = None,
) -> Stats:
    """A :class:`Stats` from a graph's replay counters (replays, copies, write-backs) and its
    costs; ``guarded``: how many tensors the address guard checks, and how."""
    return Stats(
        state=state,
        calls=counters.replays + costs.eager_calls,
        replays=counters.replays,
        copies=counters.copies,
        copies_skipped=counters.replays * n_inputs - counters.copies,
        writebacks=counters.writebacks,
        guarded_tensors=guarded[0],
        guard_check=guarded[1],
        state_writes=state_writes,
        graphs=len(getattr(recording, "graphs", (0,))) if recording is not None else 0,
        gaps=len(getattr(recording, "gaps", ())),
        gap_s=sum(gap.seconds for gap in getattr(recording, "gaps", ())),
        notices=dict(notices or {}),
        **asdict(costs),
    )
