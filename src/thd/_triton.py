"""Where the Triton kernels run: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

from torch import Tensor

__all__ = ["interpreting", "runs_triton"]


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` (read at call time: spawned workers may unset it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_triton(x: Tensor) -> bool:
    """True when a Triton kernel can run on ``x``: on its GPU, or through the interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and interpreting())
