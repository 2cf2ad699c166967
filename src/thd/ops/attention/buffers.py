"""The buffers a launch writes, allocated alike by every kernel family: ``(out, lse)`` of a forward
and ``(dq, dk, dv)`` of a backward, fresh or the call's ``accumulate`` buffers."""

from __future__ import annotations

import torch
from torch import Tensor

from thd.ops.attention.params import BackwardCall, ForwardCall

__all__ = ["delta_buffer", "forward_outputs", "gradient_buffers"]


def forward_outputs(call: ForwardCall) -> tuple[Tensor, Tensor]:
    """``call.accumulate`` when given (the launch merges into it), else fresh uninitialised
    ``out [Tq, Hq, Dv]`` in ``q.dtype`` and ``lse [Hq, Tq]`` fp32 (the kernels write every row)."""
    if call.accumulate is not None:
        return call.accumulate
    q = call.q
    num_rows, num_heads = q.shape[0], q.shape[1]
    out = q.new_empty(num_rows, num_heads, call.v.shape[2])
    return out, q.new_empty(num_heads, num_rows, dtype=torch.float32)


def gradient_buffers(call: BackwardCall, *, atomic_dq: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``call.accumulate`` when given (the launch adds into it), else fresh ``(dq, dk, dv)`` shaped
    like ``q, k, v`` in their dtypes; ``atomic_dq``: ``dq`` zeroed fp32, for atomics to add into."""
    if call.accumulate is not None:
        return call.accumulate
    q, k, v = call.saved[:3]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else _empty_like_rows(q)
    return dq, _empty_like_rows(k), _empty_like_rows(v)


def delta_buffer(call: BackwardCall, lse: Tensor) -> tuple[Tensor, bool]:
    """``(delta, given)``: ``call.delta`` and True when the call brings it and has no sinks (the
    preprocess then does not run), else a fresh buffer shaped like ``lse`` for the preprocess and
    False (with sinks the preprocess also writes the ``dsinks`` rows, so it runs)."""
    if call.delta is not None and call.saved.sinks is None:
        return call.delta, True
    return torch.empty_like(lse), False


def _empty_like_rows(x: Tensor) -> Tensor:
    """A contiguous uninitialised ``[T, H, D]`` tensor like ``x``, sized by ints (``new_empty`` of a
    ``torch.Size`` costs about a microsecond more host time)."""
    return x.new_empty(x.shape[0], x.shape[1], x.shape[2])
