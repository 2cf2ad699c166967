"""Varlen THD attention: ``kernels`` (Triton), ``reference`` (torch), ``interface`` (API).

``params`` (the typed layout, options and saved tensors) and ``dispatch`` (the unchecked
low-level calls the ring uses: :func:`forward_call`, :func:`backward_call`, :func:`runs_kernels`,
and :func:`kernel_choice`, which family ran) import without Triton; the API loads on first use.
"""

from __future__ import annotations

__all__ = [
    "AttentionOptions",
    "SavedForBackward",
    "VarlenLayout",
    "attention",
    "attention_backward",
    "attention_forward",
    "backward_call",
    "forward_call",
    "kernel_choice",
    "runs_kernels",
]

from thd.ops.attention.dispatch import backward_call, forward_call, kernel_choice, runs_kernels
from thd.ops.attention.params import AttentionOptions, SavedForBackward, VarlenLayout


def __getattr__(name: str) -> object:
    if name in ("attention", "attention_backward", "attention_forward"):
        from thd.ops.attention import interface

        return getattr(interface, name)
    raise AttributeError(f"module 'thd.ops.attention' has no attribute {name!r}")
