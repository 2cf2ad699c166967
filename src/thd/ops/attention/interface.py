"""Launchers, autograd wrapper and the public ``thd.attention`` (work in progress)."""

from __future__ import annotations

from torch import Tensor

from thd.ops.attention import reference

__all__ = ["attention", "attention_backward", "attention_forward"]


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_kv: int | None,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """Low-level forward (no autograd): ``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)``."""
    return reference.attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, causal, softmax_scale
    )


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_kv: int | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Low-level backward from saved ``out``/``lse``: ``(dq, dk, dv)``, zeros on padding rows."""
    return reference.attention_backward(
        do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
        causal, softmax_scale,
    )


attention = reference.attention
