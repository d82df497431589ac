"""The diagnostics a graph calls without importing them: verification of a new graph and the
doctor's findings for a failed capture, handed to the core once by the API layer.

The core never imports the doctor or the verifier: the API layer hands it an object with the
two methods of :class:`Diagnostics` once (:func:`install_diagnostics`). Without it a capture
error carries no doctor findings, and a requested verification is refused (not skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CaptureError, ConfigError, explain

__all__ = ["Diagnostics", "install_diagnostics", "installed"]


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


_installed = [Diagnostics()]


def install_diagnostics(diagnostics: Diagnostics) -> None:
    """Called once by the API layer: verification and capture-error findings for every graph."""
    _installed[0] = diagnostics


def installed() -> Diagnostics:
    """The diagnostics every graph calls (the library's, once the API layer is imported)."""
    return _installed[0]
