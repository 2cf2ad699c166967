"""Per-row softmax terms shared by the ``tl`` and the Gluon attention kernels.

``@triton.jit`` helpers of elementwise and row-reduction operations only, so a ``@gluon.jit`` kernel
calls them as well (they take its semantics and layouts); every call is inlined. The attention
sink adds ``exp(sink[h])`` to each row's softmax denominator and has no value row.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fold_sink", "scores_log2", "store_delta", "tanh"]

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    """``tanh(x)`` from one ``exp2`` (so the interpreter and every backend agree); saturates cleanly
    at +-1 and keeps NaN."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def scores_log2(raw, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw ``q.k`` products as scores in the log2 domain, and the tanh the softcap's derivative
    needs (``raw`` itself without ``SOFTCAP``): ``softcap * tanh(raw * scale / softcap) * log2 e``."""
    if SOFTCAP:
        t = tanh(raw * (sm_scale / softcap))
        return t * (softcap * LOG2E), t
    return raw * (sm_scale * LOG2E), raw


@triton.jit
def fold_sink(m_i, l_i, sinks_ptr, head):
    """The running ``(m_i, l_i)`` (log2 domain) with the sink's term added: ``(m_i, l_i, alpha)``,
    ``alpha`` the factor of the old sums (to rescale the accumulated output with)."""
    sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
    m_new = tl.maximum(m_i, sink)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key and a -inf sink: adds 0
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.exp2(sink - m_ref)
    return m_new, l_i, alpha


@triton.jit
def store_delta(o, do, rows, seqlen_q, q_start, head, stride_lse_h, delta_ptr):
    """Store ``delta = rowsum(o * do)`` of the real ``rows`` of a query tile (the backward's row
    term); returns ``delta`` and the rows' offsets ``at`` into the ``[H, T]`` row-term tensors."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    at = head * stride_lse_h + q_start + rows
    tl.store(delta_ptr + at, delta, mask=rows < seqlen_q)
    return delta, at
