"""FlashAttention-4 as a second oracle for ``thd.attention`` (``make test-gpu``; skipped without FA4).

FA4 (``flash_attn.cute.flash_attn_varlen_func``, CuTe DSL) is an independent implementation:
thd's out, lse and gradients must agree with it within bf16 tolerance on real rows, for packed
documents and for padded slots (FA4: ``cu_seqlens_* = slot offsets``, ``seqused_* = real
lengths``), causal and not. thd gets NaN in the padding rows of q, k, v (it never reads them)
and must write exact zeros there; FA4 gets zeros there (its padding rows are not compared).
On the GPU machine FA4 comes from ``eval "$(bash .fa4/b/fa4-wheels.sh install)"``, which puts it
on ``PYTHONPATH``. The first call of each shape class JIT-compiles FA4's kernels (seconds).
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import thd
from tests._helpers import Layout, assert_close, assert_rows_equal, make_layout, make_qkv, poison_rows

pytestmark = [
    pytest.mark.gpu,
    # FA4's stack (CuTe DSL, cuda-python, TVM FFI) may warn on import or first compile.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

DEVICE = "cuda"
# thd and FA4 each sit ~3e-3 (out) / ~5e-3 (grads) from the exact result in bf16.
OUT_ATOL = OUT_RTOL = 2.5e-2
LSE_ATOL = 2e-3
REL_OUT, REL_GRAD = 1e-2, 2e-2
ROW_FACTOR = 8.0


def _documents(
    name: str, tokens: int, lo: int, hi: int, seed: int, *, slot: int = 1, capacity: int = 0
) -> Layout:
    """Random document lengths in ``[lo, hi]`` filling ``tokens``, slots rounded up to ``slot`` rows."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(lo, hi), tokens - sum(lens)))
    return make_layout(name, lens, pad_q=[-n % slot for n in lens], capacity_q=capacity)


PACKED = _documents("packed8k-64-1024", 8192, 64, 1024, seed=0)
SLOTS64 = _documents("slots64-8k-64-1024", 8192, 64, 1024, seed=3, slot=64, capacity=50)
SLOTS128 = _documents("slots128-16k-512-8192", 16384, 512, 8192, seed=2, slot=128, capacity=100)
RAGGED = make_layout("ragged", [1, 17, 0, 300, 129, 64], pad_q=[7, 0, 3, 20, 1, 0], capacity_q=11)

CASES = [
    pytest.param(PACKED, 16, 16, 128, True, id="packed-H16-D128-causal"),
    pytest.param(PACKED, 16, 16, 128, False, id="packed-H16-D128-noncausal"),
    pytest.param(PACKED, 16, 4, 128, True, id="packed-GQA16x4-D128-causal"),
    pytest.param(SLOTS128, 16, 16, 64, True, id="slots128-H16-D64-causal"),
    pytest.param(SLOTS64, 16, 16, 128, False, id="slots64-H16-D128-noncausal"),
    pytest.param(RAGGED, 8, 8, 128, True, id="ragged-H8-D128-causal"),
]


@pytest.fixture(scope="module")
def fa4() -> Callable[..., Any]:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # not installed, or its CUDA / DSL stack does not load here
        pytest.skip(f"FlashAttention-4 (flash_attn.cute) is not importable: {type(exc).__name__}: {exc}")
    return flash_attn_varlen_func


def _thd_fwd_bwd(layout: Layout, inputs: list[Tensor], do: Tensor, causal: bool) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = thd.attention(*leaves, **layout.kwargs(DEVICE), causal=causal, return_lse=True)
    out.backward(do)
    return [out.detach(), lse.detach(), *(t.grad for t in leaves)]  # type: ignore[misc]


def _fa4_fwd_bwd(
    fa4: Callable[..., Any], layout: Layout, inputs: list[Tensor], do: Tensor, causal: bool
) -> list[Tensor | None]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    cu_q, slots_q = layout.cu("q", DEVICE)
    cu_kv, slots_kv = layout.cu("kv", DEVICE)
    kwargs: dict[str, Any] = {
        "cu_seqlens_q": slots_q,
        "cu_seqlens_k": slots_kv,
        "max_seqlen_q": layout.max_seqlen_q,
        "max_seqlen_k": layout.max_seqlen_kv,
        "causal": causal,
    }
    if layout.slots_q != layout.lens_q or layout.slots_kv != layout.lens_kv:
        kwargs["seqused_q"] = (cu_q[1:] - cu_q[:-1]).to(torch.int32).contiguous()
        kwargs["seqused_k"] = (cu_kv[1:] - cu_kv[:-1]).to(torch.int32).contiguous()
    if "return_lse" in inspect.signature(fa4).parameters:
        kwargs["return_lse"] = True
    try:
        result = fa4(*leaves, **kwargs)
    except (AssertionError, NotImplementedError) as exc:  # a limit of FA4's, not a thd result
        pytest.skip(f"FA4 does not run this case: {type(exc).__name__}: {exc}")
    out, lse = result if isinstance(result, tuple) else (result, None)
    try:
        out.backward(do)
    except (AssertionError, NotImplementedError) as exc:
        pytest.skip(f"FA4's backward does not run this case: {type(exc).__name__}: {exc}")
    if lse is not None and lse.shape == (layout.total_q, inputs[0].shape[1]):
        lse = lse.t()  # some versions return [T, H]
    return [out.detach(), None if lse is None else lse.detach(), *(t.grad for t in leaves)]


def _assert_rel(name: str, got: Tensor, want: Tensor, bound: float) -> None:
    """``||a - b|| / ||b||`` over all rows, and row by row against ``||b_r|| + rms_r ||b_r||``."""
    a, b = got.double().reshape(-1, got.shape[-1]), want.double().reshape(-1, want.shape[-1])
    diff_norm, ref_norm = float((a - b).norm()), float(b.norm())
    rel = diff_norm / ref_norm if ref_norm else (0.0 if diff_norm == 0.0 else math.inf)
    rows = b.norm(dim=-1)
    worst = float(((a - b).norm(dim=-1) / (rows + rows.square().mean().sqrt())).max()) if ref_norm else rel
    if not (rel <= bound and worst <= ROW_FACTOR * bound):
        raise AssertionError(
            f"{name}: thd vs FA4 ||a-b||/||b|| = {rel:.3e} (bound {bound:.1e}), worst row {worst:.3e} "
            f"(bound {ROW_FACTOR * bound:.1e}); non-finite in thd: {int((~torch.isfinite(got)).sum())}"
        )


@pytest.mark.parametrize(("layout", "hq", "hkv", "d", "causal"), CASES)
def test_fa4_agrees_with_thd(
    fa4: Callable[..., Any], layout: Layout, hq: int, hkv: int, d: int, causal: bool
) -> None:
    q, k, v, do = make_qkv(layout, hq, hkv, d, d, torch.bfloat16, DEVICE, poison=0.0)
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    nan_inputs = [poison_rows(q, real_q), poison_rows(k, real_kv), poison_rows(v, real_kv)]
    got = _thd_fwd_bwd(layout, nan_inputs, do, causal)
    want = _fa4_fwd_bwd(fa4, layout, [q, k, v], do, causal)

    out, lse, dq, dk, dv = got
    f_out, f_lse, f_dq, f_dk, f_dv = want
    assert f_out is not None and f_dq is not None and f_dk is not None and f_dv is not None
    assert_close(out[real_q].float(), f_out[real_q].float(), "out", atol=OUT_ATOL, rtol=OUT_RTOL)
    _assert_rel("out", out[real_q], f_out[real_q], REL_OUT)
    if f_lse is not None:
        assert_close(lse[:, real_q], f_lse[:, real_q].float(), "lse", atol=LSE_ATOL, rtol=0.0)
    for name, g, w, rows in (("dq", dq, f_dq, real_q), ("dk", dk, f_dk, real_kv), ("dv", dv, f_dv, real_kv)):
        _assert_rel(name, g[rows], w[rows], REL_GRAD)
    # thd's own guarantees on the padding rows (FA4 leaves its padding rows unspecified).
    pad_q, pad_kv = ~real_q, ~real_kv
    assert_rows_equal(out, pad_q, 0.0, "out")
    assert_rows_equal(lse, pad_q, float("-inf"), "lse", dim=1)
    for name, grad, pad in (("dq", dq, pad_q), ("dk", dk, pad_kv), ("dv", dv, pad_kv)):
        assert_rows_equal(grad, pad, 0.0, name)
