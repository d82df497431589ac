"""Diagnostics: the doctor and its findings, verification against eager."""

from .doctor import Finding, Report, doctor, findings_located_at
from .hooks import LibraryDiagnostics
from .verify import compare_with_eager, random_like, verify_against_eager

__all__ = [
    "Finding",
    "LibraryDiagnostics",
    "Report",
    "compare_with_eager",
    "doctor",
    "findings_located_at",
    "random_like",
    "verify_against_eager",
]
