"""FlashAttention-2 compatible entry points on top of :func:`thd.attention`.

:func:`flash_attn_varlen_func` and :func:`flash_attn_func` take FlashAttention 2's arguments,
defaults and return conventions, so code written against ``flash_attn`` switches by changing
its import (``from thd import flash_attn_varlen_func``). What thd does not implement is a
:class:`~thd.errors.ThdValueError` naming the argument: ``dropout_p > 0``, ``alibi_slopes``,
``block_table`` (paged KV).

Conventions kept from FlashAttention 2: causal and window masks are bottom-right aligned;
``causal=True`` bounds the window's right side at 0 whatever ``window_size[1]`` says; head dims
that are not a multiple of 8 are zero-padded to one (the default scale stays
``head_dim ** -0.5``); ``return_attn_probs=True`` returns ``(out, softmax_lse, None)`` with
``softmax_lse`` float32 ``[nheads, total_q]`` (varlen) or ``[batch, nheads, seqlen_q]``
(dense); there are no attention probabilities to return without dropout. Differences: a
query row that sees no key (and every row past ``cu_seqlens_q[-1]``) gets ``lse = -inf`` and
exact zeros in ``out`` (FlashAttention 2 leaves rows past the last sequence unwritten and
reports ``+inf``), and fp32 inputs are accepted too.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

from thd.errors import ThdError, ThdTypeError, ThdValueError
from thd.layout import INT32_MAX
from thd.ops.attention.checks import MAX_HEAD_DIM
from thd.ops.attention.interface import attention
from thd.ops.attention.keywords import ScoreArgs, Unpack

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def _check_unsupported(fn: str, dropout_p: object, alibi_slopes: object, block_table: object = None) -> None:
    """FlashAttention 2 arguments thd has no implementation for: only their neutral values pass."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ThdTypeError(
            f"{fn}: dropout_p: expected a float, got {type(dropout_p).__name__} {dropout_p!r:.60}"
        )
    if dropout_p != 0:  # NaN too
        raise ThdValueError(
            f"{fn}: dropout_p: thd has no attention dropout; expected 0.0, got {dropout_p!r} "
            "(FlashAttention's own advice: dropout_p=0.0 during evaluation)"
        )
    if alibi_slopes is not None:
        raise ThdValueError(
            f"{fn}: alibi_slopes: ALiBi biases are not supported by thd; expected None, "
            f"got {_describe(alibi_slopes)}"
        )
    if block_table is not None:
        raise ThdValueError(
            f"{fn}: block_table: paged KV caches are not supported by thd; expected None, "
            f"got {_describe(block_table)}"
        )


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return f"{type(x).__name__} {x!r:.60}"


def _causal_window(window_size: object, causal: bool) -> object:
    """FlashAttention 2 sets the right side to 0 under ``causal`` (thd refuses a right side > 0)."""
    if causal and isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        return (window_size[0], 0)
    return window_size


def _pad_last(x: Tensor, multiple: int = 8) -> Tensor:
    """``x`` with its last dim zero-padded up to a multiple of ``multiple`` (``x`` itself if it is one)."""
    extra = -x.shape[-1] % multiple
    return F.pad(x, (0, extra)) if extra else x


def _last_dim(x: object) -> int | None:
    return x.shape[-1] if isinstance(x, Tensor) and x.dim() > 0 else None


def _scores(**scores: Unpack[ScoreArgs]) -> ScoreArgs:
    """The score keywords as one dict (a plain one: ``torch.compile`` builds no TypedDict)."""
    return scores


def _varlen(
    fn: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: tuple[Tensor, Tensor],
    max_seqlens: tuple[int, int],
    scores: ScoreArgs,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`thd.attention` with FlashAttention's head-dim padding and causal window;
    thd's errors are prefixed by ``fn``."""
    head_dim, value_dim = _last_dim(q), _last_dim(v)
    softmax_scale = scores.get("softmax_scale")
    if softmax_scale is None and head_dim:
        softmax_scale = head_dim**-0.5  # of the unpadded head dim, as in FlashAttention
    padded = (
        head_dim is not None
        and value_dim is not None
        and bool(head_dim % 8 or value_dim % 8)
        and max(head_dim, value_dim) <= MAX_HEAD_DIM  # else thd's error names the dim as given
    )
    if padded:
        q, k, v = _pad_last(q), _pad_last(k), _pad_last(v)
    causal = scores.get("causal", False)
    window_size = _causal_window(scores.get("window_size", (-1, -1)), causal)
    try:
        out, lse = attention(
            q,
            k,
            v,
            *cu_seqlens,
            max_seqlen_q=max_seqlens[0],
            max_seqlen_kv=max_seqlens[1],
            return_lse=True,
            deterministic=deterministic,
            **{**scores, "softmax_scale": softmax_scale, "window_size": window_size},  # type: ignore[typeddict-item]
        )
    except ThdError as exc:
        raise type(exc)(f"{fn}: {exc}") from None
    return (out[..., :value_dim] if padded else out), lse


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention 2's ``flash_attn_varlen_func`` on :func:`thd.attention`.

    Args:
        q: ``[total_q, nheads, headdim]``; k, v: ``[total_k, nheads_k, headdim]`` (``nheads``
            a multiple of ``nheads_k``; headdim up to 256, padded to a multiple of 8 if needed).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` cumulative lengths (no padding between
            sequences; rows past ``cu_seqlens_*[-1]`` are not read).
        max_seqlen_q, max_seqlen_k: ints bounding the lengths (no device-to-host read; the layout
            is not validated, as in FlashAttention: :func:`thd.layout.validate` checks it). None
            (thd only) derives them with one device-to-host read that also validates the layout.
        dropout_p: must be 0.0. softmax_scale: default ``headdim ** -0.5``.
        causal: bottom-right aligned causal mask (the window's right side becomes 0).
        window_size: ``(left, right)``, ``-1`` unbounded. softcap: ``> 0`` caps the scores.
        alibi_slopes, block_table: must be None. deterministic: the backward without atomics.
        return_attn_probs: also return ``softmax_lse`` (float32 ``[nheads, total_q]``) and None.

    Returns:
        ``out [total_q, nheads, headdim]``, or ``(out, softmax_lse, None)``.
    """
    fn = "flash_attn_varlen_func"
    _check_unsupported(fn, dropout_p, alibi_slopes, block_table)
    scores = _scores(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    cu_seqlens, max_seqlens = (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k)
    out, lse = _varlen(fn, q, k, v, cu_seqlens, max_seqlens, scores, deterministic)
    return (out, lse, None) if return_attn_probs else out


def _dense_offsets(fn: str, batch: int, seqlen: int, device: torch.device) -> Tensor:
    """int32 ``[batch + 1]`` offsets ``b * seqlen`` built on ``device`` (no host-to-device copy)."""
    if batch * seqlen > INT32_MAX:
        raise ThdValueError(
            f"{fn}: batch * seqlen (={batch} * {seqlen}): expected at most {INT32_MAX} rows (int32 offsets)"
        )
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


def _check_dense(fn: str, q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ThdTypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ThdValueError(
                f"{fn}: {name} shape: expected [batch, seqlen, nheads, headdim], got {list(t.shape)}"
            )
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ThdValueError(
            f"{fn}: batch: expected one batch size, got q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ThdValueError(
            f"{fn}: seqlen_k: expected k and v of one length, got {k.shape[1]} and {v.shape[1]}"
        )


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention 2's ``flash_attn_func`` (dense ``[batch, seqlen, nheads, headdim]``).

    The batch is viewed as THD rows (``q.reshape(batch * seqlen_q, ...)``, a view when ``q`` is
    contiguous) with offsets ``b * seqlen`` built on the device, so the call reads nothing on the
    host and is CUDA-graph capturable. Arguments as :func:`flash_attn_varlen_func`.

    Returns:
        ``out [batch, seqlen_q, nheads, headdim]``, or ``(out, softmax_lse, None)`` with
        ``softmax_lse`` float32 ``[batch, nheads, seqlen_q]``.
    """
    fn = "flash_attn_func"
    _check_unsupported(fn, dropout_p, alibi_slopes)
    _check_dense(fn, q, k, v)
    batch, seqlen_q, heads = q.shape[:3]
    seqlen_k = k.shape[1]
    cu_q = _dense_offsets(fn, batch, seqlen_q, q.device)
    cu_k = cu_q if seqlen_k == seqlen_q else _dense_offsets(fn, batch, seqlen_k, q.device)
    rows_q, rows_k, rows_v = (x.reshape(batch * x.shape[1], *x.shape[2:]) for x in (q, k, v))
    scores = _scores(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    out, lse = _varlen(fn, rows_q, rows_k, rows_v, (cu_q, cu_k), (seqlen_q, seqlen_k), scores, deterministic)
    out = out.view(batch, seqlen_q, heads, out.shape[-1])
    if not return_attn_probs:
        return out
    return out, lse.view(heads, batch, seqlen_q).transpose(0, 1).contiguous(), None
