"""The part of a cached launch plan's key every kernel family shares (``launch.py`` for the tl
kernels, ``gluon/forward.py``): what a plan depends on besides the tensors it is launched with."""

from __future__ import annotations

from torch import Tensor

from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["inputs_key"]


def inputs_key(layout: VarlenLayout, options: AttentionOptions, q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """Flat: the offsets' length (the grid's sequences), which of the layout's optional tensors
    are given, the bounds, the options (by value) and the inputs' shapes and strides. Not the
    layout tensors themselves: a plan holds none."""
    return (
        layout.cu_seqlens_q.shape[0],
        layout.cu_seqlens_q_padded is None,
        layout.cu_seqlens_kv_padded is None,
        layout.positions_q is None,
        layout.positions_kv is None,
        layout.max_seqlen_q,
        layout.max_seqlen_kv,
        options,
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.shape,
        v.stride(),
    )
