"""Turning CUDA capture failures into plain words: classification and user locations (CPU)."""

from __future__ import annotations

import pytest

from cudagraphs.core.frames import classify_failure, user_location


@pytest.mark.parametrize(
    "message, kind",
    [
        ("CUDA error: operation not permitted when stream is capturing", "host-sync"),
        ("cudaErrorStreamCaptureUnsupported: operation not permitted", "host-sync"),
        (
            "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned",
            "cpu-tensor",
        ),
        (
            "Expected all tensors to be on the same device, but found at least two devices",
            "cpu-tensor",
        ),
        (
            "CUDA error: operation would make the legacy stream depend on a capturing blocking stream (cudaErrorStreamCaptureImplicit)",
            "default-stream",
        ),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", "out-of-memory"),
        ("CUDA error: an illegal memory access was encountered", "illegal-access"),
        (
            "CUDA error: operation failed due to a previous error during capture (cudaErrorStreamCaptureInvalidated)",
            "invalidated",
        ),
        ("something nobody has seen", "error"),
    ],
)
def test_classify_failure(message: str, kind: str) -> None:
    got, what, fix = classify_failure(RuntimeError(message))
    assert got == kind
    assert what and fix


def test_classify_looks_down_the_chain_and_at_capture_end() -> None:
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert classify_failure(outer)[0] == "host-sync"
    end = RuntimeError("cudaErrorStreamCaptureInvalidated")
    assert classify_failure(KeyError("x"), end)[0] == "invalidated"


def _user_function() -> None:
    raise RuntimeError("boom")


def test_user_location_points_at_user_code() -> None:
    try:
        _user_function()
    except RuntimeError as error:
        location = user_location(error)
    assert location is not None
    assert "test_capture_errors.py" in location and "_user_function" in location
