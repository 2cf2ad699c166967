"""Integration tests need transformers (``pip install 'thd-kernels[transformers]'``); they skip without it.

On CPU the model tests run ``thd.attention``'s torch reference (``THD_ATTENTION_BACKEND=reference``),
not the Triton interpreter, to stay fast; the few interpreter tests say so in their names.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (thd-kernels[transformers])")


@pytest.fixture(autouse=True, scope="module")
def _thd_registered() -> None:
    from thd.integrations.transformers import register

    register()  # "thd", no CP group


@pytest.fixture
def reference_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU tensors run thd's torch reference instead of the Triton interpreter."""
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    yield
