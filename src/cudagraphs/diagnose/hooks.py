"""The diagnostics the core calls through :class:`~cudagraphs.core.graphed.Diagnostics`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..core import Diagnostics, Graphed
from ..errors import CaptureError
from .doctor import doctor
from .verify import verify_against_eager

__all__ = ["LibraryDiagnostics"]

log = logging.getLogger("cudagraphs")


class LibraryDiagnostics(Diagnostics):
    """``verify=True`` compares with eager; a failed capture gets the doctor's findings."""

    def verify(self, graphed: Graphed[Any], rounds: int) -> None:
        verify_against_eager(graphed, rounds)

    def explain_capture_error(
        self, error: CaptureError, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        try:
            report = doctor(fn, *args, **kwargs)
        except Exception as failure:  # the doctor must never hide the capture error itself
            log.debug("cudagraphs: doctor failed after a capture error: %s", failure)
            return
        error.findings = report.findings
        if report.findings:
            lines = [f"    - {f.kind} at {f.location}: {f.message}" for f in report.findings[:5]]
            error.args = (str(error) + "\n  cg.doctor found:\n" + "\n".join(lines),)
