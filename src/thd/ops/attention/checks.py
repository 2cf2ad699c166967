"""Metadata checks on q, k, v shared by :func:`thd.attention` and the CP ring (no device reads)."""

from __future__ import annotations

import torch
from torch import Tensor

from thd.errors import ThdTypeError, ThdValueError

__all__ = ["FLOAT_DTYPES", "check_accumulator", "check_qkv"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(fn: str, q: object, k: object, v: object) -> None:
    """q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]`` of one floating dtype, ``Hq % Hkv == 0``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ThdTypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ThdValueError(f"{fn}: {name} shape: expected [T, H, D], got {list(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ThdTypeError(f"{fn}: {name} dtype: expected fp16/bf16/fp32/fp64, got {t.dtype}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
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
