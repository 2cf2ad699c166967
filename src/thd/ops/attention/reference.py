"""Pure-torch varlen attention: the oracle for tests and the CPU fallback, not fast.

Every sequence is computed on its own in float32. Sequence ``b``'s queries are rows
``[cu_seqlens_q_padded[b], cu_seqlens_q_padded[b] + Lq_b)`` of ``q`` and its keys the rows
``[cu_seqlens_kv_padded[b], cu_seqlens_kv_padded[b] + Lk_b)`` of ``k``/``v``, with ``L_b`` the
differences of ``cu_seqlens_*``. Causal masking is bottom-right aligned: query ``i`` sees
key ``j`` iff ``j <= i + Lk_b - Lq_b``. Rows that are not real query rows get exact zeros in
``out`` and ``-inf`` in ``lse``; so does a query that sees no key. Padding rows of the
inputs are never read.

NaN is never hidden: a NaN in a real row of ``q`` or in a key a query sees makes its ``out``
and ``lse`` NaN, a NaN in a value it sees makes its ``out`` NaN (as
``torch.nn.functional.scaled_dot_product_attention`` per sequence). A NaN value in a causally
masked key also reaches the queries of its sequence (``0 * NaN`` in the matmul, as in SDPA's
math backend); a NaN key it cannot see does not. NaN in padding rows never propagates.
Meta ``q`` gives meta outputs of the right shapes (no lengths are read).
"""

from __future__ import annotations

import torch
from torch import Tensor

from thd.ops.attention.keywords import AttentionArgs, Unpack, check_keywords, reference_options
from thd.ops.attention.params import AttentionOptions, BackwardCall, ForwardCall, VarlenLayout
from thd.ops.attention.spans import clamped_spans as sequence_spans
from thd.ops.lse_merge.reference import merge_partials_reference

__all__ = ["attention", "backward", "differentiable_forward", "forward", "sequence_spans"]


def _spans(
    q: Tensor, k: Tensor, cu_q: Tensor, cu_kv: Tensor, cup_q: Tensor | None, cup_kv: Tensor | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Per-sequence spans of both sides; none for meta ``q`` (outputs are shapes only)."""
    if q.is_meta:
        return [], []
    rows_q, rows_kv = q.shape[0], k.shape[0]  # spans clamped to the buffers, as the kernels clamp them
    return sequence_spans(cu_q, cup_q, num_rows=rows_q), sequence_spans(cu_kv, cup_kv, num_rows=rows_kv)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for half types; float64 stays float64 (so gradcheck can use tight tolerances)."""
    return torch.promote_types(x.dtype, torch.float32)


def _visible(
    lq: int, lk: int, options: AttentionOptions, device: torch.device, diagonal: int
) -> Tensor | None:
    """``[Lq, Lk]`` mask of the keys each query sees (None: all of them); query ``i`` stands at
    key index ``i + diagonal``."""
    if not options.is_masked:
        return None
    rows = torch.arange(lq, device=device)[:, None] + diagonal  # key index of each query
    cols = torch.arange(lk, device=device)[None, :]
    seen = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if options.window_left >= 0:
        seen &= cols >= rows - options.window_left
    if options.window_right >= 0:
        seen &= cols <= rows + options.window_right
    return seen


def _scores(q: Tensor, k: Tensor, options: AttentionOptions, ct: torch.dtype, diagonal: int) -> Tensor:
    """``[H, Lq, Lk]`` scores, softcapped and masked (``-inf`` where a key is not seen)."""
    scores = torch.einsum("qhd,khd->hqk", q.to(ct), k.to(ct)) * options.softmax_scale
    if options.softcap > 0:
        scores = options.softcap * torch.tanh(scores / options.softcap)
    seen = _visible(q.shape[0], k.shape[0], options, q.device, diagonal)
    return scores if seen is None else scores.masked_fill(~seen, float("-inf"))


def _sequence_attention(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, sinks: Tensor | None, diagonal: int
) -> tuple[Tensor, Tensor]:
    """One sequence: q [Lq, H, D], k [Lk, H, D], v [Lk, H, Dv] -> out, lse [H, Lq]."""
    ct = _compute_dtype(q)
    scores = _scores(q, k, options, ct, diagonal)
    if sinks is not None:  # one more logit per row, with no value row
        sink_col = sinks.to(ct)[:, None, None].expand(-1, q.shape[0], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf where no key is visible, NaN stays NaN
    probs = torch.where(_sees_a_key(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("hqk,khd->qhd", probs, v.to(ct))
    return out, lse


def _diagonals(
    q_spans: list[tuple[int, int]],
    kv_spans: list[tuple[int, int]],
    positions_q: Tensor | None,
    positions_kv: Tensor | None,
) -> list[int]:
    """Per sequence, the key index at the position of query 0 (host values)."""
    if positions_q is None or positions_kv is None:
        return [lk - lq for (_, lq), (_, lk) in zip(q_spans, kv_spans, strict=True)]
    return [pq - pk for pq, pk in zip(positions_q.tolist(), positions_kv.tolist(), strict=True)]


def _sees_a_key(lse: Tensor) -> Tensor:
    """Rows whose softmax is defined: ``lse != -inf``. NaN rows count, so NaN propagates."""
    return lse != float("-inf")


def _expand_kv(x: Tensor, num_q_heads: int) -> Tensor:
    return x.repeat_interleave(num_q_heads // x.shape[1], dim=1)


class ReferenceArgs(AttentionArgs, total=False):
    """:func:`thd.attention`'s keywords and the first positions of each sequence."""

    positions_q: Tensor | None
    positions_kv: Tensor | None


REFERENCE_ARGS = frozenset(ReferenceArgs.__optional_keys__)


def attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, **kw: Unpack[ReferenceArgs]
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference varlen attention, differentiable through autograd (``sinks`` included).

    Takes the keywords of :func:`thd.attention` and ``positions_q/kv`` (int32 ``[B]``): first
    positions of each sequence's query and key rows (see
    :class:`~thd.ops.attention.params.VarlenLayout`); ``None`` aligns the last rows.

    Same contract as :func:`thd.attention`: ``out [Tq, Hq, Dv]`` in ``q.dtype`` and, with
    ``return_lse``, ``lse [Hq, Tq]`` in float32 (float64 for float64 inputs). Computes in
    fp32 (float64 for float64 inputs). ``max_seqlen_*`` and ``deterministic`` are accepted
    and ignored.
    """
    check_keywords("reference attention", kw, REFERENCE_ARGS)
    layout = VarlenLayout(
        cu_seqlens_q,
        cu_seqlens_kv,
        kw.get("cu_seqlens_q_padded"),
        kw.get("cu_seqlens_kv_padded"),
        positions_q=kw.get("positions_q"),
        positions_kv=kw.get("positions_kv"),
    )
    options = reference_options(q, kw, causal=False)
    out, lse = differentiable_forward(q, k, v, layout, options, kw.get("sinks"))
    return (out, lse) if kw.get("return_lse", False) else out


def differentiable_forward(
    q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, options: AttentionOptions, sinks: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`attention`, through autograd."""
    num_heads = q.shape[1]
    ct = _compute_dtype(q)
    # A zero-valued anchor tied to q, k, v through empty slices (no element is read, so NaN in
    # padding rows cannot leak): backward then works, with zero gradients, even when the
    # batch has no real query row.
    anchor = (q[:0].sum() + k[:0].sum() + v[:0].sum()).to(ct)
    out = q.new_zeros(q.shape[0], num_heads, v.shape[-1], dtype=ct) + anchor
    lse = q.new_full((num_heads, q.shape[0]), float("-inf"), dtype=ct)
    q_spans, kv_spans = _layout_spans(q, k, layout)
    diagonals = _diagonals(q_spans, kv_spans, layout.positions_q, layout.positions_kv)
    for (q0, lq), (k0, lk), diagonal in zip(q_spans, kv_spans, diagonals, strict=True):
        if lq == 0:
            continue
        qs = q[q0 : q0 + lq]
        ks = _expand_kv(k[k0 : k0 + lk], num_heads)
        vs = _expand_kv(v[k0 : k0 + lk], num_heads)
        o_b, lse_b = _sequence_attention(qs, ks, vs, options, sinks, diagonal)
        rows = torch.arange(q0, q0 + lq, device=q.device)
        out = out.index_copy(0, rows, o_b)
        lse = lse.index_copy(1, rows, lse_b)
    out = out.to(q.dtype)
    lse = lse if ct == torch.float64 else lse.float()
    return out, lse


def _layout_spans(
    q: Tensor, k: Tensor, layout: VarlenLayout
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    return _spans(
        q,
        k,
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.cu_seqlens_q_padded,
        layout.cu_seqlens_kv_padded,
    )


@torch.no_grad()
def backward_delta(call: BackwardCall) -> Tensor:
    """``rowsum(dO * out)`` (fp32, shaped like ``lse``) on the layout's real query rows, 0 elsewhere."""
    do, out, layout = call.do, call.saved.out, call.layout
    delta = torch.zeros(call.saved.lse.shape, dtype=torch.float32, device=out.device)
    cu_q, slots_q = layout.cu_seqlens_q, layout.cu_seqlens_q_padded
    q_spans, _ = _spans(out, out, cu_q, cu_q, slots_q, slots_q)
    for q0, lq in q_spans:
        rows = slice(q0, q0 + lq)
        delta[:, rows] = (do[rows].float() * out[rows].float()).sum(-1).transpose(0, 1)
    return delta


@torch.no_grad()
def forward(call: ForwardCall) -> tuple[Tensor, Tensor]:
    """Forward without autograd: ``(out, lse)``; with ``call.accumulate=(out, lse)`` the log-sum-exp
    merge of that partial result and this call's, written into it (the kernel families' contract)."""
    q, k, v, layout, options, sinks, accumulate = call
    part = differentiable_forward(q, k, v, layout, options, sinks)
    if accumulate is None:
        return part
    out, lse = accumulate
    merged_out, merged_lse = merge_partials_reference([accumulate, part], out.dtype)
    out.copy_(merged_out)
    lse.copy_(merged_lse)
    return out, lse


@torch.no_grad()
def backward(call: BackwardCall) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Flash-style backward from saved ``out`` and ``lse`` (which may come from a merge).

    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * out))``,
    ``dQ = dS' K``, ``dK = dS'^T Q`` with ``dS' = scale * dS`` (times ``1 - tanh^2`` under a
    softcap); ``dsinks[h] = -sum_i exp(sinks[h] - lse_i) * rowsum(dO * out)_i``. Rows with
    ``lse = -inf`` contribute nothing; NaN (in ``lse`` or the real rows) propagates. Returns
    ``dq, dk, dv`` in the input dtypes, exact zeros on padding rows, and ``dsinks`` (or None).
    With ``call.accumulate=(dq, dk, dv)`` the gradients are added into those buffers instead.
    """
    do, (q, k, v, out, lse, sinks), layout, options, accumulate, _ = call  # delta: recomputed
    softmax_scale = options.softmax_scale
    num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    dsinks = None if sinks is None else torch.zeros(num_heads, dtype=torch.float32, device=q.device)
    q_spans, kv_spans = _layout_spans(q, k, layout)
    diagonals = _diagonals(q_spans, kv_spans, layout.positions_q, layout.positions_kv)
    for (q0, lq), (k0, lk), diagonal in zip(q_spans, kv_spans, diagonals, strict=True):
        if lq == 0:
            continue
        qs, dos = q[q0 : q0 + lq].float(), do[q0 : q0 + lq].float()
        lse_b = lse[:, q0 : q0 + lq].float()
        delta = (dos * out[q0 : q0 + lq].float()).sum(-1).transpose(0, 1)  # [H, Lq]
        if dsinks is not None:
            p_sink = torch.where(_sees_a_key(lse_b), torch.exp(sinks.float()[:, None] - lse_b), 0.0)  # type: ignore[union-attr]
            dsinks -= (p_sink * delta).sum(1)
        if lk == 0:
            continue
        ks = _expand_kv(k[k0 : k0 + lk], num_heads).float()
        vs = _expand_kv(v[k0 : k0 + lk], num_heads).float()
        raw = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        scores = raw
        if options.softcap > 0:
            scores = options.softcap * torch.tanh(raw / options.softcap)
        seen = _visible(lq, lk, options, q.device, diagonal)
        if seen is not None:
            scores = scores.masked_fill(~seen, float("-inf"))
        probs = torch.where(_sees_a_key(lse_b)[..., None], torch.exp(scores - lse_b[..., None]), 0.0)
        dp = torch.einsum("qhd,khd->hqk", dos, vs)
        ds = probs * (dp - delta[..., None]) * softmax_scale
        if options.softcap > 0:
            ds = ds * (1 - torch.tanh(raw / options.softcap) ** 2)
        dq[q0 : q0 + lq] = torch.einsum("hqk,khd->qhd", ds, ks)
        dk_b = torch.einsum("hqk,qhd->khd", ds, qs)
        dv_b = torch.einsum("hqk,qhd->khd", probs, dos)
        dk[k0 : k0 + lk] += dk_b.unflatten(1, (-1, group)).sum(2)
        dv[k0 : k0 + lk] += dv_b.unflatten(1, (-1, group)).sum(2)
    dsinks_out = None if dsinks is None else dsinks.to(sinks.dtype)  # type: ignore[union-attr]
    if accumulate is None:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks_out
    for buffer, grad, like in zip(accumulate, (dq, dk, dv), (q, k, v), strict=True):
        buffer.add_(grad.to(like.dtype))  # zero on every row outside the layout's real rows
    return (*accumulate, dsinks_out)
