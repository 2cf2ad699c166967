"""CUDA-graph capture detection that is safe on CPU-only builds of torch."""

from __future__ import annotations

import torch

__all__ = ["is_capturing"]


def is_capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph.

    ``torch.cuda.is_current_stream_capturing()`` raises on CPU-only builds, so CUDA
    availability is checked first. Host syncs (``.item()``, ``.tolist()``, ``.cpu()``)
    are illegal whenever this returns True.
    """
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
