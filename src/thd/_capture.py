"""CUDA-graph capture detection that is safe on CPU-only builds of torch."""

from __future__ import annotations

import functools

import torch

__all__ = ["is_capturing"]


@functools.cache
def _has_cuda() -> bool:
    """Whether this process has a CUDA device (asked once: a capture needs one, and the answer
    cannot turn from no to yes while torch runs; the call costs as much as the capture check)."""
    return torch.cuda.is_available()


def is_capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph.

    ``torch.cuda.is_current_stream_capturing()`` raises on CPU-only builds, so CUDA
    availability is checked first. Host syncs (``.item()``, ``.tolist()``, ``.cpu()``)
    are illegal whenever this returns True.
    """
    return _has_cuda() and torch.cuda.is_current_stream_capturing()
