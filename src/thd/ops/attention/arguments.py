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
    check_head_dim,
    check_layout_tensors,
    check_max_seqlen,
    check_qkv,
    check_softmax_scale,
)
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["check_call", "resolve_options"]


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
    return sides[0], sides[1]


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
    if not isinstance(q, Tensor):
        raise ThdTypeError(f"{fn}: q: expected a torch.Tensor, got {type(q).__name__}")
    scale = check_softmax_scale(fn, softmax_scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cap = _finite_real(fn, "softcap", softcap)
    if cap < 0:
        raise ThdValueError(f"{fn}: softcap: expected >= 0 (0: off), got {cap}")
    return AttentionOptions(
        float(scale), bool(causal), _window(fn, window_size, bool(causal)), cap, bool(deterministic)
    )


def _check_sinks(fn: str, q: Tensor, sinks: object) -> None:
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
    check_qkv(fn, q, k, v)
    if q.dtype == torch.float64:
        raise ThdTypeError(f"{fn}: q dtype: expected fp16/bf16/fp32, got {q.dtype}")
    check_head_dim(fn, "q/k head_dim", q.shape[2])
    check_head_dim(fn, "v head_dim", v.shape[2])
    check_layout_tensors(fn, q, k, *layout.tensors()[:4])
    check_max_seqlen(fn, "max_seqlen_q", layout.max_seqlen_q)
    check_max_seqlen(fn, "max_seqlen_kv", layout.max_seqlen_kv)
    if sinks is not None:
        _check_sinks(fn, q, sinks)
    _check_positions(fn, q, layout)


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
