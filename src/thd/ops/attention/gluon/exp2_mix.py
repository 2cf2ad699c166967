"""``exp2`` of the Gluon forward's softmax with one element in ``every`` computed on the FMA pipe.

At head dim 64 one 64 x 128 tile of scores costs the multi-function unit (16 ``exp2`` per clock and
SM) about as many cycles as its two products cost the tensor cores, so the softmax of one consumer
warpgroup cannot hide under the products of another. FlashAttention-4 moves part of the exponentials
to the FMA units on Blackwell; :func:`exp2_mixed` does that here: in every ``every`` consecutive
registers of a thread, the last is a degree-3 polynomial (relative error below 1.1e-4, under half a
bf16 or fp16 unit in the last place of the probability it becomes), the others ``ex2.approx.ftz``
(as ``gl.exp2``).

The polynomial step (:func:`exp2_poly_reference` is its torch model, which the tests check):
``t = max(x, -127)`` (NaN kept), ``n = round(t)`` by the 1.5 * 2^23 shift, ``f = t - n`` in
``[-1/2, 1/2]``, ``p(f) ~ 2^f``, ``2^n`` built from the bits ``(n + 127) << 23`` and multiplied in:
``x = -inf`` (a masked score) gives exactly 0 (``2^n`` is then the bit pattern 0), NaN stays NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from thd.ops.attention.gluon.compat import gl, gluon

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["EXP2_POLY_COEFFS", "exp2_asm", "exp2_mixed", "exp2_poly_reference"]

EXP2_POLY_COEFFS = (0.693282961845398, 0.2422109842300415, 0.05500887334346771)
"""``c1, c2, c3`` of ``2^f ~ 1 + c1 f + c2 f^2 + c3 f^3`` on ``[-1/2, 1/2]`` (fp32 values; a weighted
least-squares fit, relative error 1.02e-4 at most)."""

_SHIFT = 12582912.0  # 1.5 * 2^23: t + _SHIFT rounds t to an integer held in the low mantissa bits


def _f32_hex(value: float) -> str:
    import struct

    return "0f" + struct.pack(">f", value).hex().upper()


def exp2_asm(every: int) -> str:
    """PTX for ``inline_asm_elementwise`` with ``pack=every`` on fp32 registers: outputs ``$0 ..
    $every-1``, inputs ``$every .. $2every-1``; the last element by the polynomial."""
    if every < 2:
        raise ValueError(f"every must be at least 2, got {every}")
    c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY_COEFFS)
    shift = _f32_hex(_SHIFT)
    last = every - 1
    lines = [f"ex2.approx.ftz.f32 ${i}, ${every + i};" for i in range(last)]
    lines += [
        "{",
        ".reg .f32 t, j, r, f, p, e;",
        ".reg .b32 b;",
        f"max.NaN.f32 t, ${every + last}, 0fC2FE0000;",  # -127
        f"add.rn.f32 j, t, {shift};",
        f"sub.rn.f32 r, j, {shift};",
        "sub.rn.f32 f, t, r;",
        f"fma.rn.f32 p, f, {c3}, {c2};",
        f"fma.rn.f32 p, p, f, {c1};",
        "fma.rn.f32 p, p, f, 0f3F800000;",
        "mov.b32 b, j;",
        "shl.b32 b, b, 23;",
        "add.s32 b, b, 1065353216;",  # 127 << 23
        "mov.b32 e, b;",
        f"mul.rn.f32 ${last}, p, e;",
        "}",
    ]
    return "\n".join(lines)


def _constraints(every: int) -> str:
    return ",".join(["=r"] * every + ["r"] * every)


EXP2_ASM_4 = gl.constexpr(exp2_asm(4)) if gl is not None else None
EXP2_ASM_8 = gl.constexpr(exp2_asm(8)) if gl is not None else None
CONSTRAINTS_4 = gl.constexpr(_constraints(4)) if gl is not None else None
CONSTRAINTS_8 = gl.constexpr(_constraints(8)) if gl is not None else None


def _exp2_mixed(x, EVERY: gl.constexpr):  # type: ignore[no-untyped-def]
    """``exp2(x)`` of fp32 ``x``: ``EVERY`` 0 all by ``exp2``, 4 or 8 one in ``EVERY`` by the
    polynomial (the module docstring)."""
    if EVERY == 4:
        return gl.inline_asm_elementwise(
            EXP2_ASM_4, CONSTRAINTS_4, [x.to(gl.int32, bitcast=True)], dtype=gl.int32, is_pure=True, pack=4
        ).to(gl.float32, bitcast=True)
    elif EVERY == 8:
        return gl.inline_asm_elementwise(
            EXP2_ASM_8, CONSTRAINTS_8, [x.to(gl.int32, bitcast=True)], dtype=gl.int32, is_pure=True, pack=8
        ).to(gl.float32, bitcast=True)
    else:
        return gl.exp2(x)


exp2_mixed = gluon.jit(_exp2_mixed) if gluon is not None else None


def exp2_poly_reference(x: Tensor) -> Tensor:
    """The polynomial step of :func:`exp2_asm` in fp32 torch operations, step for step (the bit
    arithmetic on 32-bit words as the GPU does it)."""
    import torch

    x = x.to(torch.float32)
    t = torch.where(torch.isnan(x), x, torch.clamp(x, min=-127.0))
    j = t + _SHIFT
    f = t - (j - _SHIFT)
    c1, c2, c3 = (torch.tensor(c, dtype=torch.float32) for c in EXP2_POLY_COEFFS)
    p = (f * c3 + c2) * f + c1
    p = p * f + 1.0
    word = ((j.view(torch.int32).to(torch.int64) << 23) + (127 << 23)) & 0xFFFFFFFF
    bits = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return p * bits.view(torch.float32)
