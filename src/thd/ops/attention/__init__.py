"""Varlen THD attention: ``kernels`` (Triton), ``reference`` (torch), ``interface`` (API).

``params`` (the typed layout and options) imports without Triton; the API loads on first use.
"""

from __future__ import annotations

__all__ = ["AttentionOptions", "VarlenLayout", "attention", "attention_backward", "attention_forward"]

from thd.ops.attention.params import AttentionOptions, VarlenLayout


def __getattr__(name: str) -> object:
    if name in ("attention", "attention_backward", "attention_forward"):
        from thd.ops.attention import interface

        return getattr(interface, name)
    raise AttributeError(f"module 'thd.ops.attention' has no attribute {name!r}")
