"""A dense, differentiable stand-in for ``thd.attention`` that takes ``window_size``.

It follows the documented ``thd.attention`` contract (bottom-right aligned causal mask;
``window_size=(left, right)``: query i at key position ``i' = i + Lk - Lq`` sees key j iff
``i' - left <= j <= i' + right``, ``-1`` unbounded) so that the integration's window
convention can be checked against transformers' sliding masks with any thd version.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["windowed_attention"]


def windowed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    *,
    cu_seqlens_q_padded: Tensor | None = None,
    cu_seqlens_kv_padded: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    deterministic: bool = False,
) -> Tensor:
    del max_seqlen_q, max_seqlen_kv, deterministic
    assert not return_lse
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cu_q, cu_kv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    start_q = (cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded).tolist()
    start_kv = (cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded).tolist()
    group = q.shape[1] // k.shape[1]
    rows = []
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        if lq == 0:
            continue
        qb = q[start_q[b] : start_q[b] + lq].transpose(0, 1)
        kb, vb = (
            t[start_kv[b] : start_kv[b] + lk].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v)
        )
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        left, right = window_size
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        s = (qb @ kb.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        rows.append((start_q[b], lq, (torch.softmax(s, -1) @ vb).transpose(0, 1)))
    for start, n, o in rows:
        out = out.index_copy(0, torch.arange(start, start + n), o.to(out.dtype))
    return out
