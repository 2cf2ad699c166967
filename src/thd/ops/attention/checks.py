"""Metadata checks of attention arguments shared by :func:`thd.attention` and the CP ring.

None of them reads device memory. Every failure is a :class:`~thd.errors.ThdTypeError` (wrong
type or dtype) or :class:`~thd.errors.ThdValueError` (wrong value, shape or device) whose
message starts with the entry point ``fn`` and names the argument and the value it got.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from thd.errors import ThdTypeError, ThdValueError
from thd.layout import check_cu_metadata

__all__ = [
    "FLOAT_DTYPES",
    "MAX_FLOAT32",
    "MAX_HEAD_DIM",
    "MAX_SEQLEN_LIMIT",
    "check_accumulator",
    "check_saved_outputs",
    "check_head_dim",
    "check_layout_tensors",
    "check_max_seqlen",
    "check_qkv",
    "check_softmax_scale",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
MAX_SEQLEN_LIMIT = 2**31 - 1
"""Largest ``max_seqlen_*`` accepted: row indices are int32 in the kernels."""
MAX_FLOAT32 = torch.finfo(torch.float32).max
"""Largest ``|softmax_scale|`` and ``softcap``: they reach the kernels as float32."""


def check_max_seqlen(fn: str, name: str, value: object) -> int | None:
    """``None`` or an int in ``[0, 2**31 - 1]`` (numpy integers too; never bool, float or tensor)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ThdTypeError(f"{fn}: {name}: expected an int or None, got {type(value).__name__} {value!r:.60}")
    if not 0 <= int(value) <= MAX_SEQLEN_LIMIT:
        raise ThdValueError(
            f"{fn}: {name}: expected an int in [0, {MAX_SEQLEN_LIMIT}] or None, got {int(value)}"
        )
    return int(value)


def check_softmax_scale(fn: str, value: object) -> float | None:
    """``None`` (the default ``D ** -0.5``) or a finite real number (int or float, numpy too)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ThdTypeError(
            f"{fn}: softmax_scale: expected a float or None, got {type(value).__name__} {value!r:.60}"
        )
    if not math.isfinite(float(value)) or abs(float(value)) > MAX_FLOAT32:
        raise ThdValueError(
            f"{fn}: softmax_scale: expected a number finite in float32 (|x| <= {MAX_FLOAT32:.4g}), "
            f"got {float(value)!r}"
        )
    return float(value)


def check_head_dim(fn: str, name: str, dim: int) -> None:
    """A head dim the kernels take: a multiple of 8 from 8 to 256."""
    if dim % 8 or not 8 <= dim <= MAX_HEAD_DIM:
        raise ThdValueError(f"{fn}: {name}: expected a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {dim}")


def check_layout_tensors(
    fn: str,
    q: Tensor,
    k: Tensor,
    cu_q: object,
    cu_kv: object,
    cup_q: object | None,
    cup_kv: object | None,
) -> None:
    """The four offset tensors: int32 ``[B+1]`` of one length, ``cu_q``/``cup_q`` on q's device and
    ``cu_kv``/``cup_kv`` on k's device (values are not read: see :func:`thd.layout.validate`)."""
    for side, t, cu, cup in (("q", q, cu_q, cup_q), ("kv", k, cu_kv, cup_kv)):
        names = (f"cu_seqlens_{side}", f"cu_seqlens_{side}_padded")
        check_cu_metadata(fn, cu, cup, names=names)
        assert isinstance(cu, Tensor)
        if cu.device != t.device:
            raise ThdValueError(
                f"{fn}: {names[0]} device: expected {t.device} (as {side[0]}), got {cu.device}"
            )
    assert isinstance(cu_q, Tensor) and isinstance(cu_kv, Tensor)
    if cu_kv.shape != cu_q.shape:
        raise ThdValueError(
            f"{fn}: cu_seqlens_kv shape: expected {list(cu_q.shape)} (as cu_seqlens_q), "
            f"got {list(cu_kv.shape)}"
        )


def check_qkv(fn: str, q: object, k: object, v: object) -> None:
    """q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]`` of one floating dtype on one device,
    ``Hq % Hkv == 0``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ThdTypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ThdValueError(f"{fn}: {name} shape: expected [T, H, D], got {list(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ThdTypeError(f"{fn}: {name} dtype: expected fp16/bf16/fp32/fp64, got {t.dtype}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ThdValueError(f"{fn}: {name} device: expected {q.device} (as q), got {t.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ThdTypeError(f"{fn}: q, k, v dtypes: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:2] != v.shape[:2]:
        raise ThdValueError(
            f"{fn}: k and v shapes: expected equal [T, H_KV], got k {list(k.shape)} and v {list(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ThdValueError(f"{fn}: head_dim: q has {q.shape[2]}, k has {k.shape[2]}; expected equal")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ThdValueError(
            f"{fn}: heads: expected q heads ({q.shape[1]}) to be a multiple of k/v heads ({k.shape[1]})"
        )


def check_accumulator(fn: str, q: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> None:
    """A partial result to accumulate into: out ``[Tq, Hq, Dv]`` (last dim contiguous), lse ``[Hq, Tq]``
    fp32 (rows contiguous), on q's device."""
    want_out = [q.shape[0], q.shape[1], v.shape[2]]
    if list(out.shape) != want_out or out.stride(-1) != 1:
        raise ThdValueError(
            f"{fn}: accumulate out: expected shape {want_out} with a contiguous last dim, "
            f"got shape {list(out.shape)} strides {list(out.stride())}"
        )
    if list(lse.shape) != [q.shape[1], q.shape[0]] or lse.dtype != torch.float32 or lse.stride(-1) != 1:
        raise ThdValueError(
            f"{fn}: accumulate lse: expected float32 shape {[q.shape[1], q.shape[0]]} with contiguous rows, "
            f"got {lse.dtype} shape {list(lse.shape)} strides {list(lse.stride())}"
        )
    for name, t in (("out", out), ("lse", lse)):
        if t.device != q.device:
            raise ThdValueError(f"{fn}: accumulate {name} device: expected {q.device} (as q), got {t.device}")


def check_saved_outputs(fn: str, q: Tensor, v: Tensor, do: object, out: object, lse: object) -> None:
    """The backward's ``do`` and ``out`` ``[Tq, Hq, Dv]`` (fp16/bf16/fp32, any strides) and ``lse``
    float32 ``[Hq, Tq]``, on q's device: the kernels index them by q's rows and heads."""
    want = [q.shape[0], q.shape[1], v.shape[2]]
    for name, t, shape, dtypes in (
        ("do", do, want, FLOAT_DTYPES[:3]),
        ("out", out, want, FLOAT_DTYPES[:3]),
        ("lse", lse, [q.shape[1], q.shape[0]], (torch.float32,)),
    ):
        if not isinstance(t, Tensor):
            raise ThdTypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if list(t.shape) != shape or t.dtype not in dtypes:
            raise ThdValueError(
                f"{fn}: {name}: expected {'/'.join(str(d) for d in dtypes)} of shape {shape}, "
                f"got {t.dtype} of shape {list(t.shape)}"
            )
        if t.device != q.device:
            raise ThdValueError(f"{fn}: {name} device: expected {q.device} (as q), got {t.device}")
