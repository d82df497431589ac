"""Diagnostics: the doctor and its findings, verification against eager."""
