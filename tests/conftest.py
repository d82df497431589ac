"""GPU tests carry the `cuda` marker: skipped without a GPU, refused to skip under gpu-check."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    if os.environ.get("CUDAGRAPHS_REQUIRE_CUDA"):
        raise pytest.UsageError(
            "CUDAGRAPHS_REQUIRE_CUDA is set but torch.cuda.is_available() is False: the GPU "
            "suite would skip instead of run"
        )
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
