"""Shared fixtures. The CPU lane runs Triton kernels through the interpreter."""

from __future__ import annotations

import os

import pytest

# Must be set before any module defining @triton.jit kernels is imported. A GPU lane
# (make test-gpu) runs on a machine with CUDA and leaves it unset.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the release tool's light environment has no torch
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
