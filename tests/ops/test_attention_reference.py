"""The oracle itself: ``thd.reference.attention`` against a dense masked softmax(QK^T)V.

The dense oracle below builds the full ``[Tq, Tk]`` visibility matrix of a layout from host
row maps, in float64, with no per-sequence loop: a different construction from the
reference's, so the two cannot share a bug in the index math.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests._helpers import Layout, assert_close, assert_rows_equal, make_layout, make_qkv, poison_rows
from thd.ops.attention import AttentionOptions, VarlenLayout, reference
from thd.ops.attention.params import BackwardCall, SavedForBackward

LAYOUTS = [
    make_layout("packed", [5, 9, 3]),
    make_layout("slot_pad", [4, 1, 7], pad_q=[3, 2, 1]),
    make_layout("tail_pad", [6, 5], pad_q=[0, 4]),
    make_layout("capacity", [3, 8], pad_q=[1, 0], capacity_q=5),
    make_layout("empty_one", [0, 1, 6, 0, 1], pad_q=[2, 0, 1, 0, 3], capacity_q=2),
    make_layout("cross", [3, 9, 1, 0, 4], [7, 2, 0, 5, 4], pad_q=[1, 0, 2, 1, 0], pad_kv=[0, 3, 1, 0, 2]),
]
HEADS = [(2, 2, 8, 8), (4, 2, 8, 8), (2, 1, 8, 4)]  # (Hq, Hkv, D, Dv): MHA, GQA, MQA with Dv != D


def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: Layout, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Masked softmax(scale * QK^T)V over the whole buffer in float64: ``(out, lse)``."""
    rows_q, rows_kv = layout.row_positions("q"), layout.row_positions("kv")
    visible = torch.zeros(len(rows_q), len(rows_kv), dtype=torch.bool)
    for r, (bq, i, lq) in enumerate(rows_q):
        for c, (bk, j, lk) in enumerate(rows_kv):
            visible[r, c] = bq >= 0 and bq == bk and (not causal or j <= i + lk - lq)
    qz = poison_rows(q.double(), layout.real_rows("q"), 0.0)
    kz = poison_rows(k.double(), layout.real_rows("kv"), 0.0)
    vz = poison_rows(v.double(), layout.real_rows("kv"), 0.0)
    group = q.shape[1] // k.shape[1]
    kz, vz = kz.repeat_interleave(group, dim=1), vz.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qz, kz) * scale
    masked = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    # Rows with no visible key: softmax over finite zeros, then zeroed by the mask (no NaN).
    safe = torch.where(visible.any(-1, keepdim=True), masked, torch.zeros_like(masked))
    probs = torch.softmax(safe, dim=-1) * visible
    return torch.einsum("hqk,khd->qhd", probs, vz), lse


def _case_id(layout: Layout, heads: tuple[int, int, int, int], causal: bool) -> str:
    hq, hkv, d, dv = heads
    return f"{layout.describe()}-H{hq}x{hkv}-D{d}x{dv}-causal{int(causal)}"


CASES = [
    pytest.param(layout, heads, causal, id=_case_id(layout, heads, causal))
    for layout in LAYOUTS
    for heads in HEADS
    for causal in (False, True)
]


@pytest.mark.parametrize(("layout", "heads", "causal"), CASES)
def test_reference_matches_dense_oracle(
    layout: Layout, heads: tuple[int, int, int, int], causal: bool
) -> None:
    hq, hkv, d, dv = heads
    q, k, v, do = make_qkv(layout, hq, hkv, d, dv, torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = 0.37
    out, lse = reference.attention(
        q, k, v, **layout.kwargs(), causal=causal, softmax_scale=scale, return_lse=True
    )
    q0, k0, v0 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    exp_out, exp_lse = dense_attention(q0, k0, v0, layout, causal, scale)
    # The reference works in fp32 internally, whatever the input dtype.
    tol = {"atol": 1e-5, "rtol": 1e-5}
    assert_close(out, exp_out, "out", **tol)
    assert_close(lse, exp_lse.float(), "lse", **tol)
    out.backward(do)
    exp_out.backward(do)
    for name, got, want in (("dq", q.grad, q0.grad), ("dk", k.grad, k0.grad), ("dv", v.grad, v0.grad)):
        assert got is not None and want is not None
        assert_close(got, want, name, **tol)
    pad_q, pad_kv = ~layout.real_rows("q"), ~layout.real_rows("kv")
    assert_rows_equal(out, pad_q, 0.0, "out")
    assert_rows_equal(lse, pad_q, float("-inf"), "lse", dim=1)
    for name, grad, pad in (("dq", q.grad, pad_q), ("dk", k.grad, pad_kv), ("dv", v.grad, pad_kv)):
        assert grad is not None
        assert_rows_equal(grad, pad, 0.0, name)


@pytest.mark.parametrize("causal", [False, True], ids=["causal0", "causal1"])
@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[4], LAYOUTS[5]], ids=lambda lay: lay.describe())
def test_reference_backward_matches_autograd(layout: Layout, causal: bool) -> None:
    """``attention_backward`` (flash-style, from saved out/lse) equals autograd of ``attention``."""
    q, k, v, do = make_qkv(layout, 4, 2, 16, 8, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = layout.kwargs()
    scale = 16**-0.5
    out, lse = reference.attention(q, k, v, **kw, causal=causal, return_lse=True)
    out.backward(do)
    varlen = VarlenLayout(
        kw["cu_seqlens_q"], kw["cu_seqlens_kv"], kw["cu_seqlens_q_padded"], kw["cu_seqlens_kv_padded"]
    )
    saved = SavedForBackward(q.detach(), k.detach(), v.detach(), out.detach(), lse)
    dq, dk, dv, _ = reference.backward(BackwardCall(do, saved, varlen, AttentionOptions(scale, causal)))
    for name, got, want in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert want is not None
        assert_close(got, want, name, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["causal0", "causal1"])
def test_reference_gradcheck(causal: bool) -> None:
    """float64 gradcheck on a tiny padded GQA layout with a zero-length and a one-token sequence.

    The reference computes float64 inputs in float64, so gradcheck's default step and
    tolerances apply.
    """
    layout = make_layout("tiny", [3, 0, 1, 4], [2, 1, 0, 4], pad_q=[1, 1, 0, 0], pad_kv=[0, 1, 1, 0])
    q, k, v, _ = make_qkv(layout, 2, 1, 4, 3, torch.float64, poison=0.0)
    kw = layout.kwargs()

    def fn(q_: Tensor, k_: Tensor, v_: Tensor) -> Tensor:
        return reference.attention(q_, k_, v_, **kw, causal=causal)

    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, inputs)


def test_reference_ignores_padding_rows() -> None:
    """NaN and huge values in padding rows give bitwise the same result."""
    layout = LAYOUTS[4]
    q, k, v, _ = make_qkv(layout, 2, 1, 8, 8, torch.float32)
    kw = layout.kwargs()
    out_nan, lse_nan = reference.attention(q, k, v, **kw, causal=True, return_lse=True)
    big = [poison_rows(t, layout.real_rows(side), 3e38) for t, side in ((q, "q"), (k, "kv"), (v, "kv"))]
    out_big, lse_big = reference.attention(*big, **kw, causal=True, return_lse=True)
    assert torch.equal(out_nan, out_big)
    assert torch.equal(lse_nan, lse_big)


def test_reference_query_without_visible_key_is_zero_with_finite_grads() -> None:
    """Causal with Lq > Lk: the first Lq - Lk queries see nothing; Lk = 0 sees nothing at all."""
    layout = make_layout("blind", [5, 3], [2, 0])
    q, k, v, do = make_qkv(layout, 2, 2, 8, 8, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(q, k, v, **layout.kwargs(), causal=True, return_lse=True)
    blind = torch.tensor([True, True, True, False, False, True, True, True])
    assert_rows_equal(out, blind, 0.0, "out")
    assert_rows_equal(lse, blind, float("-inf"), "lse", dim=1)
    out.backward(do)
    for name, grad in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert grad is not None
        assert bool(torch.isfinite(grad).all()), f"{name} has non-finite values"
    assert q.grad is not None
    assert_rows_equal(q.grad, blind, 0.0, "dq")


def test_reference_all_sequences_empty() -> None:
    layout = make_layout("empty", [0, 0, 0], capacity_q=4)
    q, k, v, _ = make_qkv(layout, 2, 2, 8, 8, torch.float32)
    out, lse = reference.attention(q, k, v, **layout.kwargs(), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((lse == float("-inf")).all())


def test_reference_backward_without_real_queries() -> None:
    layout = make_layout("no_queries", [0, 0], [3, 2], capacity_q=2)
    q, k, v, do = make_qkv(layout, 2, 2, 8, 8, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = reference.attention(q, k, v, **layout.kwargs())
    out.backward(do)
    for grad in (q.grad, k.grad, v.grad):
        assert grad is not None and torch.equal(grad, torch.zeros_like(grad))
