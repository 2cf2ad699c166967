"""``attention_forward(..., accumulate=(out, lse))``: one launch folded into a partial result.

The oracle for two non-causal calls over key sets A and B is ``thd.reference.attention`` over
the per-sequence concatenation ``[A_b; B_b]``; for a causal first call it is the reference
log-sum-exp merge of the two reference partials. Runs the Triton kernels through the
interpreter on CPU (tiny shapes) and on a GPU under the ``gpu`` marker (realistic sizes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from tests._helpers import (
    Layout,
    assert_close,
    assert_rows_equal,
    make_layout,
    make_qkv,
    poisoned_allocations,
)
from thd.errors import ThdValueError
from thd.ops.attention import (
    AttentionOptions,
    SavedForBackward,
    VarlenLayout,
    attention_forward,
    backward_call,
    reference,
)
from thd.ops.attention.params import BackwardCall, ForwardCall
from thd.ops.lse_merge.reference import merge_partials_reference

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CUDA = torch.cuda.is_available()
_TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
_TF32 = 2.5e-2  # fp32 inputs on a GPU go through TF32 tensor cores (10-bit mantissa)


def _tol(dtype: torch.dtype, device: str) -> tuple[float, float]:
    return (_TF32, _TF32) if device == "cuda" and dtype == torch.float32 else _TOL[dtype]


@pytest.fixture(autouse=True)
def _poison_fresh_memory() -> Iterator[None]:
    with poisoned_allocations():
        yield


def _devices() -> list[object]:
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs CUDA")]),
    ]


def _sizes(device: str) -> tuple[list[int], list[int], list[int], list[int], int]:
    """``(lens_q, lens_a, lens_b, pad_q, head_dim)``: a zero-length sequence and padding in each."""
    if device == "cpu":
        return [9, 0, 21, 4], [9, 3, 21, 4], [7, 5, 0, 30], [3, 2, 0, 5], 32
    lens_q, lens_a = [700, 0, 2049, 1300, 64], [700, 80, 2049, 1300, 64]
    return lens_q, lens_a, [512, 400, 0, 3000, 129], [4, 8, 0, 12, 3], 128


def _cat_keys(a: Layout, b: Layout, ka: Tensor, kb: Tensor) -> Tensor:
    """Per sequence, the real rows of ``ka`` then those of ``kb``, packed without padding."""
    cup_a, cup_b = a.cu("kv")[1], b.cu("kv")[1]
    rows = []
    for i in range(len(a.lens_kv)):
        rows.append(ka[int(cup_a[i]) : int(cup_a[i]) + a.lens_kv[i]])
        rows.append(kb[int(cup_b[i]) : int(cup_b[i]) + b.lens_kv[i]])
    return torch.cat(rows)


def _varlen(layout: Layout, device: torch.device | str) -> VarlenLayout:
    args = layout.kwargs(device)
    return VarlenLayout(
        args["cu_seqlens_q"],
        args["cu_seqlens_kv"],
        args["cu_seqlens_q_padded"],
        args["cu_seqlens_kv_padded"],
        args["max_seqlen_q"],
        args["max_seqlen_kv"],
    )


def _call(
    q: Tensor, k: Tensor, v: Tensor, layout: Layout, causal: bool, **kw: object
) -> tuple[Tensor, Tensor]:
    varlen = _varlen(layout, q.device)
    return attention_forward(q, k, v, varlen, AttentionOptions(q.shape[-1] ** -0.5, causal), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("acc_fp32", [False, True], ids=["acc_dtype", "acc_fp32"])
def test_two_calls_equal_attention_over_the_union_of_keys(
    device: str, dtype: torch.dtype, acc_fp32: bool
) -> None:
    lens_q, lens_a, lens_b, pad_q, dim = _sizes(device)
    heads_q, heads_kv = 4, 2  # GQA
    a = make_layout("a", lens_q, lens_a, pad_q=pad_q, pad_kv=[1] * len(lens_q), capacity_q=3)
    b = make_layout("b", lens_q, lens_b, pad_q=pad_q, pad_kv=[2] * len(lens_q), capacity_q=3)
    union = make_layout(
        "union",
        lens_q,
        [x + y for x, y in zip(lens_a, lens_b, strict=True)],
        pad_q=pad_q,
        pad_kv=0,
        capacity_q=3,
        capacity_kv=0,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    q, ka, va, _ = make_qkv(a, heads_q, heads_kv, dim, dim, dtype, device, generator=gen)
    _, kb, vb, _ = make_qkv(b, heads_q, heads_kv, dim, dim, dtype, device, generator=gen)
    q = q.clone()  # the NaN padding rows of q are shared by both calls

    out, lse = _call(q, ka, va, a, False)
    if acc_fp32:
        out = out.float()
    got_out, got_lse = _call(q, kb, vb, b, False, accumulate=(out, lse))
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr(), "not in place"

    k_cat, v_cat = _cat_keys(a, b, ka, kb), _cat_keys(a, b, va, vb)
    want_out, want_lse = reference.attention(
        q.float(), k_cat.float(), v_cat.float(), **union.kwargs(device), return_lse=True
    )
    atol, rtol = _tol(dtype, device)
    assert_close(got_out, want_out, "out", atol=atol, rtol=rtol)
    lse_tol = _TF32 if device == "cuda" else 1e-3
    assert_close(got_lse, want_lse, "lse", atol=lse_tol, rtol=lse_tol)
    pad = ~a.real_rows("q")
    assert_rows_equal(got_out, pad, 0.0, "out")
    assert_rows_equal(got_lse, pad, float("-inf"), "lse", dim=1)


@pytest.mark.parametrize("device", _devices())
def test_causal_partial_then_accumulate_matches_reference_merge(device: str) -> None:
    """Like a ring: a causal diagonal step, then a step whose queries are a subset of the rows."""
    lens_q, _, lens_b, pad_q, dim = _sizes(device)
    dtype = torch.float32
    diag = make_layout("diag", lens_q, pad_q=pad_q)
    # Second step: sequence 0 gets no query (its rows must stay bit-exact), others a prefix.
    part_q = [0, *(n // 2 for n in lens_q[1:])]
    pad_part = [s - n for s, n in zip(diag.slots_q, part_q, strict=True)]
    step = make_layout("step", part_q, lens_b, pad_q=pad_part, pad_kv=[1] * len(lens_q))
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v, _ = make_qkv(diag, 2, 2, dim, dim, dtype, device, generator=gen)
    _, kb, vb, _ = make_qkv(step, 2, 2, dim, dim, dtype, device, generator=gen)

    out, lse = _call(q, k, v, diag, True)
    first_out, first_lse = out.clone(), lse.clone()
    _call(q, kb, vb, step, False, accumulate=(out, lse))

    ref_a = reference.attention(q, k, v, **diag.kwargs(device), causal=True, return_lse=True)
    ref_b = reference.attention(q, kb, vb, **step.kwargs(device), causal=False, return_lse=True)
    want_out, want_lse = merge_partials_reference([ref_a, ref_b], dtype)
    atol, rtol = _tol(dtype, device)
    assert_close(out, want_out, "out", atol=atol, rtol=rtol)
    assert_close(lse, want_lse, "lse", atol=atol, rtol=rtol)
    untouched = ~step.real_rows("q")
    assert torch.equal(out[untouched], first_out[untouched]), "rows outside the call changed"
    assert torch.equal(lse[:, untouched], first_lse[:, untouched]), "lse outside the call changed"


@pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_reference_backend_accumulates_like_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    lens_q, lens_a, lens_b, pad_q, dim = _sizes("cpu")
    a = make_layout("a", lens_q, lens_a, pad_q=pad_q)
    b = make_layout("b", lens_q, lens_b, pad_q=pad_q, pad_kv=[1] * len(lens_q))
    q, ka, va, _ = make_qkv(a, 2, 1, dim, dim, torch.float32)
    _, kb, vb, _ = make_qkv(b, 2, 1, dim, dim, torch.float32)
    kernel = _call(q, kb, vb, b, False, accumulate=tuple(t.clone() for t in _call(q, ka, va, a, False)))
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    ref = _call(q, kb, vb, b, False, accumulate=tuple(t.clone() for t in _call(q, ka, va, a, False)))
    assert_close(kernel[0], ref[0], "out", atol=2e-4, rtol=2e-4)
    assert_close(kernel[1], ref[1], "lse", atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("out_shape", r"accumulate out: expected shape \[\d+, 2, 32\]"),
        ("out_stride", "accumulate out: .*contiguous last dim"),
        ("lse_dtype", "accumulate lse: expected float32"),
        ("lse_shape", r"accumulate lse: expected float32 shape \[2, \d+\]"),
    ],
)
def test_rejects_a_bad_accumulator(bad: str, match: str) -> None:
    layout = make_layout("a", [5, 3], pad_q=[1, 0])
    q, k, v, _ = make_qkv(layout, 2, 2, 32, 32, torch.float32, poison=None)
    out = torch.zeros(layout.total_q, 2, 32)
    lse = torch.full((2, layout.total_q), float("-inf"))
    if bad == "out_shape":
        out = out[:-1]
    elif bad == "out_stride":
        out = torch.zeros(layout.total_q, 2, 64)[..., ::2]
    elif bad == "lse_dtype":
        lse = lse.double()
    else:
        lse = lse.t().contiguous()
    with pytest.raises(ThdValueError, match=match):
        _call(q, k, v, layout, False, accumulate=(out, lse))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["split", "fast"])
def test_backward_accumulates_two_launches_into_fp32_buffers(
    device: str, dtype: torch.dtype, deterministic: bool
) -> None:
    """Like a windowed ring step: two launches over overlapping query and key rows of the same
    tensors add their dQ, dK, dV into fp32 buffers; every row neither launch owns keeps its value."""
    lens_q, lens_kv, _, pad_q, dim = _sizes(device)
    whole = make_layout("whole", lens_q, lens_kv, pad_q=pad_q, pad_kv=[2] * len(lens_q), capacity_q=3)
    part_q, part_kv = [n // 2 for n in lens_q], [n - n // 3 for n in lens_kv]
    part = make_layout(
        "part",
        part_q,
        part_kv,
        pad_q=[s - n for s, n in zip(whole.slots_q, part_q, strict=True)],
        pad_kv=[s - n for s, n in zip(whole.slots_kv, part_kv, strict=True)],
        capacity_q=3,
    )
    gen = torch.Generator(device=device).manual_seed(3)
    q, k, v, do = make_qkv(whole, 4, 2, dim, dim, dtype, device, generator=gen)
    init = [torch.randn(t.shape, generator=gen, device=device) for t in (q, k, v)]
    buffers = tuple(t.clone() for t in init)
    want = [t.double() for t in init]
    for layout, causal in ((whole, True), (part, False)):
        varlen = _varlen(layout, device)
        options = AttentionOptions(dim**-0.5, causal, deterministic=deterministic)
        out, lse = reference.forward(ForwardCall(q, k, v, varlen, options))
        got = backward_call(BackwardCall(do, SavedForBackward(q, k, v, out, lse), varlen, options, buffers))
        assert all(g is b for g, b in zip(got[:3], buffers, strict=True)), "not the given buffers"
        saved = SavedForBackward(q.float(), k.float(), v.float(), out.float(), lse)
        grads = reference.backward(BackwardCall(do.float(), saved, varlen, options))
        want = [w + g.double() for w, g in zip(want, grads[:3], strict=True)]
    atol, rtol = _tol(dtype, device)
    for name, got_t, want_t in zip(("dq", "dk", "dv"), buffers, want, strict=True):
        assert got_t.dtype == torch.float32
        assert_close(got_t, want_t.float(), name, atol=atol * 4, rtol=rtol * 4)
    for name, got_t, start, side in (("dq", buffers[0], init[0], "q"), ("dk", buffers[1], init[1], "kv"),
                                     ("dv", buffers[2], init[2], "kv")):  # fmt: skip
        outside = ~whole.real_rows(side, device)
        assert torch.equal(got_t[outside], start[outside]), f"{name}: rows outside both launches changed"
