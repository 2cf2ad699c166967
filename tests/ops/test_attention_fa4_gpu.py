"""FlashAttention-4 as a second oracle for ``thd.attention`` (``make test-gpu``; skipped without FA4).

FA4 (``flash_attn.cute.flash_attn_varlen_func``, CuTe DSL) is an independent implementation:
thd's out, lse and gradients must agree with it within bf16 tolerance on real rows, for packed
documents and for padded slots (FA4: ``cu_seqlens_* = slot offsets``, ``seqused_* = real
lengths``), causal and not. thd gets NaN in the padding rows of q, k, v (it never reads them)
and must write exact zeros there; FA4 gets zeros there (its padding rows are not compared).
On the GPU machine FA4 comes from ``eval "$(bash .fa4/b/fa4-wheels.sh install)"``, which puts it
on ``PYTHONPATH``. The first call of each shape class JIT-compiles FA4's kernels (seconds).

Variants (``test_fa4_agrees_with_thd_variants``): FA4 4.0.0b36's varlen function has the same
semantics for each (read in its ``flash_attn/cute`` sources): ``window_size=(left, right)``
(``None`` = unbounded; ``causal=True`` forces ``right = 0``) with the same bottom-right
alignment as thd (``mask.py``: key limits ``row + seqlen_k - seqlen_q - left`` to
``row + seqlen_k - seqlen_q + right`` inclusive, per sequence from ``seqused_*``);
``softcap * tanh(scale * q.k / softcap)`` (the scale is applied before the cap); and
``learnable_sink`` ``[Hq]`` (fp16/bf16/fp32) adding ``exp(sink[h])`` to each row's denominator,
with the returned lse including it and a gradient ``-sum_rows exp(sink - lse) * rowsum(dO * O)``
over real rows only, in the sink's dtype. A keyword the installed FA4 lacks skips its cases.
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


def _thd_fwd_bwd(
    layout: Layout,
    inputs: list[Tensor],
    do: Tensor,
    causal: bool,
    *,
    sinks: Tensor | None = None,
    **options: Any,
) -> list[Tensor]:
    """``[out, lse, dq, dk, dv]``, and ``dsinks`` last when ``sinks`` is given; ``options``: more
    ``thd.attention`` keywords (``window_size``, ``softcap``)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    kwargs = {**layout.kwargs(DEVICE), **options}
    if sink_leaf is not None:
        kwargs["sinks"] = sink_leaf
    out, lse = thd.attention(*leaves, **kwargs, causal=causal, return_lse=True)
    out.backward(do)
    extra = [] if sink_leaf is None else [sink_leaf.grad]
    return [out.detach(), lse.detach(), *(t.grad for t in leaves), *extra]  # type: ignore[misc]


def _fa4_variant_kwargs(
    fa4: Callable[..., Any], window_size: tuple[int, int], softcap: float, sinks: Tensor | None
) -> dict[str, Any]:
    """FA4 keywords for thd's variant settings; skips when the installed FA4 lacks one of them.

    thd's ``-1`` (unbounded side) is FA4's ``None``; FA4's window is bottom-right aligned per
    sequence like thd's, and ``causal=True`` sets its right side to 0 as thd requires.
    """
    wanted: dict[str, Any] = {}
    if tuple(window_size) != (-1, -1):
        wanted["window_size"] = tuple(None if w < 0 else int(w) for w in window_size)
    if softcap > 0.0:
        wanted["softcap"] = float(softcap)
    if sinks is not None:
        wanted["learnable_sink"] = sinks
    params = inspect.signature(fa4).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in wanted if name not in params and not takes_any]
    if missing:
        pytest.skip(f"the installed FA4's flash_attn_varlen_func has no keyword {', '.join(missing)}")
    return wanted


def _fa4_fwd_bwd(
    fa4: Callable[..., Any],
    layout: Layout,
    inputs: list[Tensor],
    do: Tensor,
    causal: bool,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> list[Tensor | None]:
    """``[out, lse, dq, dk, dv]`` of FA4 (lse None if it returns none), and its ``learnable_sink``
    gradient last when ``sinks`` is given (None if it gives none)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    variant = _fa4_variant_kwargs(fa4, window_size, softcap, sink_leaf)
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
    kwargs.update(variant)
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
    extra = [] if sink_leaf is None else [sink_leaf.grad]
    return [out.detach(), None if lse is None else lse.detach(), *(t.grad for t in leaves), *extra]


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
    _assert_agree(layout, got, want)


def _assert_agree(
    layout: Layout, got: list[Tensor], want: list[Tensor | None], *, lse_atol: float = LSE_ATOL
) -> None:
    """thd's ``[out, lse, dq, dk, dv]`` against FA4's on real rows, and thd's padding rows."""
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    out, lse, dq, dk, dv = got[:5]
    f_out, f_lse, f_dq, f_dk, f_dv = want[:5]
    assert f_out is not None and f_dq is not None and f_dk is not None and f_dv is not None
    assert_close(out[real_q].float(), f_out[real_q].float(), "out", atol=OUT_ATOL, rtol=OUT_RTOL)
    _assert_rel("out", out[real_q], f_out[real_q], REL_OUT)
    if f_lse is not None:
        assert_close(lse[:, real_q], f_lse[:, real_q].float(), "lse", atol=lse_atol, rtol=0.0)
    for name, g, w, rows in (("dq", dq, f_dq, real_q), ("dk", dk, f_dk, real_kv), ("dv", dv, f_dv, real_kv)):
        _assert_rel(name, g[rows], w[rows], REL_GRAD)
    # thd's own guarantees on the padding rows (FA4 leaves its padding rows unspecified).
    pad_q, pad_kv = ~real_q, ~real_kv
    assert_rows_equal(out, pad_q, 0.0, "out")
    assert_rows_equal(lse, pad_q, float("-inf"), "lse", dim=1)
    for name, grad, pad in (("dq", dq, pad_q), ("dk", dk, pad_kv), ("dv", dv, pad_kv)):
        assert_rows_equal(grad, pad, 0.0, name)


# --- variants: sliding window, softcap, sinks ---------------------------------------------------

# Cross attention with Lq <= Lk per sequence (every query sees a key under the bottom-right
# causal window), slot padding on both sides (FA4 gets it as seqused_q / seqused_k).
CROSS = make_layout(
    "cross",
    [300, 1000, 64, 2000, 517, 1],
    [700, 1000, 100, 3000, 517, 129],
    pad_q=[4, 0, 60, 48, 11, 127],
    pad_kv=[0, 24, 28, 8, 59, 0],
    capacity_q=13,
    capacity_kv=0,
)
SOFTCAP = 5.0  # bends the scores of N(0, 1) inputs (tanh(4 / 5) = 0.66)
# FA4 computes the softcap's tanh with the hardware approximation (fastmath, relative error about
# 2**-11, so about 5e-4 * |score| per score); lse, an average of scores, gets a looser bound.
LSE_ATOL_SOFTCAP = 5e-3
FP32, BF16 = torch.float32, torch.bfloat16

# (layout, Hq, Hkv, D, causal, window_size, softcap, sink dtype or None)
VARIANT_CASES = [
    pytest.param(PACKED, 16, 4, 128, True, (256, 0), 0.0, None, id="packed-GQA16x4-D128-causal-window256"),
    pytest.param(SLOTS128, 16, 16, 64, True, (1000, 0), 0.0, None, id="slots128-H16-D64-causal-window1000"),
    pytest.param(PACKED, 16, 16, 128, False, (100, 300), 0.0, None, id="packed-H16-D128-window100x300"),
    pytest.param(CROSS, 8, 2, 128, True, (200, 0), 0.0, None, id="cross-GQA8x2-D128-causal-window200"),
    pytest.param(PACKED, 16, 16, 128, True, (-1, -1), SOFTCAP, None, id="packed-H16-D128-causal-softcap"),
    pytest.param(SLOTS64, 16, 16, 64, False, (-1, -1), SOFTCAP, None, id="slots64-H16-D64-softcap"),
    pytest.param(PACKED, 16, 4, 128, True, (-1, -1), 0.0, FP32, id="packed-GQA16x4-D128-causal-sinks"),
    pytest.param(SLOTS64, 16, 16, 64, True, (-1, -1), 0.0, BF16, id="slots64-H16-D64-causal-sinks-bf16"),
    pytest.param(SLOTS128, 16, 4, 128, True, (512, 0), SOFTCAP, FP32, id="slots128-GQA16x4-D128-all-three"),
    pytest.param(RAGGED, 8, 8, 64, True, (32, 0), SOFTCAP, FP32, id="ragged-H8-D64-all-three"),
]


@pytest.mark.parametrize(
    ("layout", "hq", "hkv", "d", "causal", "window_size", "softcap", "sink_dtype"), VARIANT_CASES
)
def test_fa4_agrees_with_thd_variants(
    fa4: Callable[..., Any],
    layout: Layout,
    hq: int,
    hkv: int,
    d: int,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    sink_dtype: torch.dtype | None,
) -> None:
    """thd and FA4 with the same window / softcap / sinks: out, lse (with the sink term), dq, dk,
    dv and the sinks' gradient agree on real rows; thd's padding rows hold exact zeros."""
    q, k, v, do = make_qkv(layout, hq, hkv, d, d, torch.bfloat16, DEVICE, poison=0.0)
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    nan_inputs = [poison_rows(q, real_q), poison_rows(k, real_kv), poison_rows(v, real_kv)]
    # Sink logits around 2 (spread 2): a visible share of the softmax of short rows and windows.
    sinks = None if sink_dtype is None else (torch.randn(hq, device=DEVICE) * 2.0 + 2.0).to(sink_dtype)
    want = _fa4_fwd_bwd(
        fa4, layout, [q, k, v], do, causal, window_size=window_size, softcap=softcap, sinks=sinks
    )
    options: dict[str, Any] = {"window_size": window_size, "softcap": softcap}
    got = _thd_fwd_bwd(layout, nan_inputs, do, causal, sinks=sinks, **options)
    _assert_agree(layout, got, want, lse_atol=LSE_ATOL_SOFTCAP if softcap > 0.0 else LSE_ATOL)
    if sinks is not None:
        dsinks, f_dsinks = got[5], want[5]
        assert dsinks is not None and dsinks.shape == sinks.shape and dsinks.dtype == sinks.dtype
        if f_dsinks is not None:  # FA4 4.0.0b36 gives one (sm90/sm100); compare whenever it does
            _assert_rel("dsinks", dsinks.float(), f_dsinks.float(), REL_GRAD)
