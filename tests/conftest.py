"""Shared fixtures. The CPU lane runs Triton kernels through the interpreter."""

from __future__ import annotations

import os
from collections.abc import Iterator

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

try:  # property tests: the same examples on every run unless THD_HYPOTHESIS_PROFILE=explore
    from hypothesis import settings

    settings.register_profile("repeatable", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("THD_HYPOTHESIS_PROFILE", "repeatable"))
except ImportError:  # the release tool's light environment may lack hypothesis
    pass


@pytest.fixture(autouse=True)
def _seed() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(0)


@pytest.fixture
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every device-to-host read raise, as it would be illegal under capture."""
    import torch

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("host read of device data")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "equal", boom)


@pytest.fixture(params=["reference", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``thd.attention`` forced onto the torch reference or the Triton kernels (interpreter on CPU)."""
    import thd._runtime.config

    if request.param == "triton" and not thd._runtime.config.interpreting():  # CPU tensors: interpreter only
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    monkeypatch.setenv("THD_ATTENTION_BACKEND", request.param)
    return request.param


@pytest.fixture
def fresh_detection_cache() -> Iterator[None]:
    """An empty padding-detection cache (and counters) before and after the test."""
    from thd.padding import clear_detection_cache

    clear_detection_cache()
    yield
    clear_detection_cache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
