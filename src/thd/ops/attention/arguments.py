"""Checks of one attention call's arguments (metadata only: no device reads).

Every failure is a :class:`thd.ThdError` naming the argument and the value it got.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from thd.errors import ThdTypeError, ThdValueError
from thd.ops.attention.checks import (
    MAX_FLOAT32,
    MAX_HEAD_DIM,
    MAX_SEQLEN_LIMIT,
    check_head_dim,
    check_layout_tensors,
    check_max_seqlen,
    check_qkv,
    check_softmax_scale,
)
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["check_call", "check_sinks", "passes_call_checks", "resolve_options"]


def _finite_real(fn: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ThdTypeError(f"{fn}: {name}: expected a real number, got {type(value).__name__} {value!r:.60}")
    if not math.isfinite(float(value)):
        raise ThdValueError(f"{fn}: {name}: expected a finite number, got {value!r}")
    return float(value)


def _window(fn: str, window_size: object, causal: bool) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ThdTypeError(f"{fn}: window_size: expected a (left, right) pair of ints, got {window_size!r}")
    sides = []
    for side, value in zip(("left", "right"), window_size, strict=True):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ThdTypeError(f"{fn}: window_size {side}: expected an int >= -1, got {value!r}")
        if int(value) < -1:
            raise ThdValueError(
                f"{fn}: window_size {side}: expected an int >= -1 (-1: unbounded), got {value}"
            )
        sides.append(int(value))
    if causal and sides[1] > 0:
        raise ThdValueError(
            f"{fn}: window_size right: causal=True means right = 0, got window_size={tuple(sides)}"
        )
    # No sequence is longer than MAX_SEQLEN_LIMIT, so a side that large bounds nothing: stored as
    # -1 (the kernels take window sides as int32).
    left, right = (-1 if side >= MAX_SEQLEN_LIMIT else side for side in sides)
    return left, right


def _default_scale(fn: str, q: Tensor) -> float:
    """``D ** -0.5``; q's shape and head dim checked first (the options are resolved before
    :func:`check_call`, and a head dim of 0 has no scale)."""
    if q.dim() != 3:
        raise ThdValueError(f"{fn}: q shape: expected [T, H, D], got {list(q.shape)}")
    check_head_dim(fn, "q/k head_dim", q.shape[2])
    return q.shape[2] ** -0.5


_COMMON_OPTIONS: dict[tuple, AttentionOptions] = {}
"""Options of the common call by their arguments: one shared (immutable) object per distinct call."""


def resolve_options(
    fn: str,
    q: Tensor,
    causal: object,
    softmax_scale: object,
    window_size: object,
    softcap: object,
    deterministic: object,
) -> AttentionOptions:
    """Checked options, with the default scale ``D ** -0.5``."""
    if isinstance(q, Tensor) and q.dim() == 3 and type(window_size) is tuple and len(window_size) == 2:
        # The common call (float or default scale, int window, float or int softcap) in a few
        # comparisons; anything else, every error included, takes the checks below.
        left, right = window_size
        scale = softmax_scale
        if (
            type(left) is int
            and type(right) is int
            and -1 <= left < MAX_SEQLEN_LIMIT
            and -1 <= right < MAX_SEQLEN_LIMIT
            and (scale is None or (type(scale) is float and -MAX_FLOAT32 <= scale <= MAX_FLOAT32))
            and (type(softcap) is float or type(softcap) is int)
            and 0 <= softcap <= MAX_FLOAT32
            and not (causal and right > 0)
        ):
            key = (scale, q.shape[-1], bool(causal), left, right, softcap, bool(deterministic))
            options = _COMMON_OPTIONS.get(key)
            if options is None:
                if len(_COMMON_OPTIONS) >= 1024:
                    _COMMON_OPTIONS.clear()
                options = AttentionOptions(
                    softmax_scale=float(_default_scale(fn, q) if scale is None else scale),
                    causal=key[2],
                    window_size=(left, right),
                    softcap=float(softcap),
                    deterministic=key[6],
                )
                if scale != 0.0:  # 0.0 and -0.0 are one key but not one scale: never shared
                    _COMMON_OPTIONS[key] = options
            return options
    if not isinstance(q, Tensor):
        raise ThdTypeError(f"{fn}: q: expected a torch.Tensor, got {type(q).__name__}")
    scale = check_softmax_scale(fn, softmax_scale)
    scale = _default_scale(fn, q) if scale is None else scale
    cap = _finite_real(fn, "softcap", softcap)
    if not 0 <= cap <= MAX_FLOAT32:
        raise ThdValueError(f"{fn}: softcap: expected 0 (off) to {MAX_FLOAT32:.4g} (float32), got {cap}")
    return AttentionOptions(
        softmax_scale=float(scale),
        causal=bool(causal),
        window_size=_window(fn, window_size, bool(causal)),
        softcap=cap,
        deterministic=bool(deterministic),
    )


def check_sinks(fn: str, q: Tensor, sinks: object) -> None:
    if not isinstance(sinks, Tensor):
        raise ThdTypeError(f"{fn}: sinks: expected a torch.Tensor or None, got {type(sinks).__name__}")
    if list(sinks.shape) != [q.shape[1]]:
        raise ThdValueError(
            f"{fn}: sinks shape: expected [{q.shape[1]}] (one per query head), got {list(sinks.shape)}"
        )
    if sinks.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ThdTypeError(f"{fn}: sinks dtype: expected float32/bfloat16/float16, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ThdValueError(f"{fn}: sinks device: expected {q.device} (as q), got {sinks.device}")


def check_call(
    fn: str, q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, options: AttentionOptions, sinks: object
) -> None:
    """Shapes, dtypes, devices and scalar arguments of one call."""
    if passes_call_checks(q, k, v, layout, sinks):
        return
    check_qkv(fn, q, k, v)
    if q.dtype == torch.float64:
        raise ThdTypeError(f"{fn}: q dtype: expected fp16/bf16/fp32, got {q.dtype}")
    check_head_dim(fn, "q/k head_dim", q.shape[2])
    check_head_dim(fn, "v head_dim", v.shape[2])
    check_layout_tensors(fn, q, k, *layout.tensors()[:4])
    check_max_seqlen(fn, "max_seqlen_q", layout.max_seqlen_q)
    check_max_seqlen(fn, "max_seqlen_kv", layout.max_seqlen_kv)
    if sinks is not None:
        check_sinks(fn, q, sinks)
    _check_positions(fn, q, layout)


_HALF_OR_SINGLE = (torch.float16, torch.bfloat16, torch.float32)


def passes_call_checks(q: object, k: object, v: object, layout: VarlenLayout, sinks: object) -> bool:
    """True only if every check of :func:`check_call` passes: the common call (fp16/bf16/fp32, no
    positions, int or None bounds) in a few comparisons, each offset tensor met again (the offsets
    often fill several fields) taken as checked. False says nothing: run the checks."""
    if type(layout) is not VarlenLayout:
        return False
    cu_q, cu_kv = layout.cu_seqlens_q, layout.cu_seqlens_kv
    if (
        layout.positions_q is not None
        or layout.positions_kv is not None
        or not isinstance(q, Tensor)
        or not isinstance(k, Tensor)
        or not isinstance(v, Tensor)
        or not isinstance(cu_q, Tensor)
    ):
        return False
    dtype = q.dtype
    if dtype not in _HALF_OR_SINGLE or k.dtype is not dtype or v.dtype is not dtype:
        return False
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return False
    _, heads, dim = q.shape
    rows_kv, kv_heads, dim_k = k.shape
    rows_v, v_heads, dim_v = v.shape
    if (
        dim_k != dim
        or rows_v != rows_kv
        or v_heads != kv_heads
        or kv_heads == 0
        or heads % kv_heads
        or dim % 8
        or dim_v % 8
        or not 8 <= dim <= MAX_HEAD_DIM
        or not 8 <= dim_v <= MAX_HEAD_DIM
    ):
        return False
    if cu_q.dtype is not torch.int32 or cu_q.dim() != 1 or cu_q.shape[0] < 1:
        return False
    device = q.device
    if k.device != device or v.device != device or cu_q.device != device:
        return False
    if cu_kv is not cu_q and not _offsets_like(cu_kv, cu_q):
        return False
    for cup in (layout.cu_seqlens_q_padded, layout.cu_seqlens_kv_padded):
        if cup is not None and cup is not cu_q and not _offsets_like(cup, cu_q):
            return False
    for bound in (layout.max_seqlen_q, layout.max_seqlen_kv):
        if bound is not None and not (type(bound) is int and 0 <= bound <= MAX_SEQLEN_LIMIT):
            return False
    return sinks is None or (
        isinstance(sinks, Tensor)
        and sinks.dim() == 1
        and sinks.shape[0] == heads
        and sinks.dtype in _HALF_OR_SINGLE
        and sinks.device == device
    )


def _offsets_like(t: object, cu_q: Tensor) -> bool:
    """Whether ``t`` is an int32 tensor of ``cu_q``'s shape on its device (``cu_q`` checked)."""
    return (
        isinstance(t, Tensor)
        and t.dtype is torch.int32
        and t.dim() == 1
        and t.shape[0] == cu_q.shape[0]
        and t.device == cu_q.device
    )


def _check_positions(fn: str, q: Tensor, layout: VarlenLayout) -> None:
    given = [layout.positions_q is not None, layout.positions_kv is not None]
    if not any(given):
        return
    if not all(given):
        raise ThdValueError(f"{fn}: positions_q and positions_kv: expected both or neither, got only one")
    want = [layout.cu_seqlens_q.shape[0] - 1]
    for name, t in (("positions_q", layout.positions_q), ("positions_kv", layout.positions_kv)):
        assert t is not None
        if (
            not isinstance(t, Tensor)
            or t.dtype != torch.int32
            or list(t.shape) != want
            or t.device != q.device
        ):
            got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
            raise ThdValueError(f"{fn}: {name}: expected int32 {want} on {q.device}, got {got}")
