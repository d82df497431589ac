"""What the core asks of the diagnostics layer, which the API layer installs.

The core never imports the doctor or the verifier: :func:`install` hands it an object with these
two methods once, at import of :mod:`cudagraphs.api`. The defaults do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CaptureError

__all__ = ["Diagnostics", "current", "install"]


class Diagnostics:
    """Verification of a new graph, and the doctor's findings for a failed capture."""

    def verify(self, graphed: Any, rounds: int) -> None:
        """Raise :class:`~cudagraphs.errors.VerificationError` if the graph differs from eager."""

    def explain_capture_error(
        self, error: CaptureError, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        """Add what the doctor finds to a capture error's message."""


_installed = Diagnostics()


def install(diagnostics: Diagnostics) -> None:
    """Called once by the API layer: verification and capture-error findings for every graph."""
    global _installed
    _installed = diagnostics


def current() -> Diagnostics:
    return _installed
