"""Zeroing of THD padding rows: ``kernels`` (Triton), ``reference`` (torch), ``interface`` (API)."""

from thd.ops.zero_padding.interface import zero_padding_

__all__ = ["zero_padding_"]
