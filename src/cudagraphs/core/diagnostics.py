"""What the core asks of the diagnostics layer, which the API layer installs.

The core never imports the doctor or the verifier: :func:`install` hands it an object with these
two methods once, at import of :mod:`cudagraphs.api`. Without it a capture error carries no
doctor findings, and a requested verification is refused (not skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CaptureError, ConfigError, explain

__all__ = ["Diagnostics", "current", "install"]


class Diagnostics:
    """Verification of a new graph, and the doctor's findings for a failed capture."""

    def verify(self, graphed: Any, rounds: int) -> None:
        """Raise :class:`~cudagraphs.errors.VerificationError` if the graph differs from eager.

        Without the diagnostics layer (the core used on its own) a requested verification
        is refused, never skipped silently."""
        if rounds:
            raise ConfigError(
                explain(
                    f"verify={rounds} was asked for, but the verifier is not loaded",
                    "the core does not import the diagnostics layer; cudagraphs.api installs it",
                    "create graphs through cg.graph (import cudagraphs), or pass verify=0",
                )
            )

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
