"""Varlen THD attention: ``kernels`` (Triton), ``reference`` (torch), ``interface`` (API)."""

from thd.ops.attention.interface import attention, attention_backward, attention_forward

__all__ = ["attention", "attention_backward", "attention_forward"]
