"""Tools on top of the library: profile, bench and its report, timing, the CLI, the demo,
``cg.auto``. Each loads on first use of a name (rich is imported only then).

Right: ``from cudagraphs.tools import bench``. Wrong: importing ``cudagraphs.tools.benchmarking``
from another package of the library: this module is the one door."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import first_use

if TYPE_CHECKING:
    from .benchmarking import bench
    from .choosing import Auto, AutoReport, auto
    from .cli import main
    from .demo import run_demo
    from .profiling import Profile, profile
    from .report import BenchReport, ModeResult
    from .timing import measure, measure_side_by_side

_WHERE = {
    "Auto": "choosing",
    "AutoReport": "choosing",
    "BenchReport": "report",
    "ModeResult": "report",
    "Profile": "profiling",
    "auto": "choosing",
    "bench": "benchmarking",
    "main": "cli",
    "measure": "timing",
    "measure_side_by_side": "timing",
    "profile": "profiling",
    "run_demo": "demo",
}

__all__ = [
    "Auto",
    "AutoReport",
    "BenchReport",
    "ModeResult",
    "Profile",
    "auto",
    "bench",
    "main",
    "measure",
    "measure_side_by_side",
    "profile",
    "run_demo",
]


__getattr__ = first_use(__name__, _WHERE)
