"""``thd.attention`` through the Triton interpreter (CPU lane) against ``thd.reference.attention``.

Shapes stay tiny (sequences of at most 40 tokens, 1-4 heads, D 32 or 64): the interpreter runs
every program one after the other. Every case poisons the padding rows of q, k, v with NaN and
checks forward (out, lse) and backward (dq, dk, dv) against the reference, then checks the
exact zeros / -inf on every non-real row.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import product
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

import thd
from tests._helpers import (
    Layout,
    assert_close,
    assert_rows_equal,
    make_layout,
    make_qkv,
    poison_rows,
    poisoned_allocations,
    tolerance,
)
from tests._strategies import random_layouts
from thd.errors import ThdTypeError, ThdValueError
from thd.ops.attention import AttentionOptions, VarlenLayout, attention_backward, attention_forward, reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU lane: needs TRITON_INTERPRET=1 so that CPU tensors run the Triton kernels",
)


@pytest.fixture(autouse=True)
def _poison_fresh_memory() -> Iterator[None]:
    """Fresh allocations hold NaN, so an output row the kernels never write cannot pass as 0."""
    with poisoned_allocations():
        yield


LAYOUTS = [
    make_layout("packed", [17, 33, 5]),
    make_layout("slot_pad", [13, 1, 29], pad_q=[3, 7, 3]),
    make_layout("tail_pad", [20, 11], pad_q=[0, 5]),
    make_layout("capacity", [9, 24], pad_q=[3, 0], capacity_q=10),
    make_layout("empty_one", [0, 1, 18, 0, 1], pad_q=[4, 0, 2, 0, 2], capacity_q=4),
    # Cross attention: Lq != Lk per sequence, a query side with Lk = 0 and a key side with Lq = 0;
    # causal with Lq > Lk leaves the first Lq - Lk queries with no visible key.
    make_layout(
        "cross",
        [7, 30, 1, 0],
        [19, 12, 0, 5],
        pad_q=[1, 2, 0, 3],
        pad_kv=[0, 4, 2, 1],
        capacity_q=2,
        capacity_kv=5,
    ),
]
# Causal offsets Lk - Lq = 31, 30, 32, -31, 1, around the edges of 32-row tiles.
CROSS_OFFSETS = make_layout(
    "cross_offsets", [2, 10, 5, 40, 39], [33, 40, 37, 9, 40], pad_q=[0, 1, 2, 3, 0], pad_kv=[1, 0, 3, 2, 0]
)
# (Hq, Hkv, D, Dv): MHA, GQA 2 groups of 2, MQA with Dv > D, MQA with D = 64 > Dv.
HEADS = [(2, 2, 32, 32), (4, 2, 32, 32), (1, 1, 32, 64), (2, 1, 64, 32)]
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _case(
    layout: Layout,
    heads: tuple[int, int, int, int],
    causal: bool,
    dtype: torch.dtype,
    *,
    given_max: bool,
    scale: float | None,
) -> Any:
    hq, hkv, d, dv = heads
    case_id = (
        f"{layout.name}-T{layout.total_q}x{layout.total_kv}-H{hq}x{hkv}-D{d}x{dv}-"
        f"{_DTYPE_NAMES[dtype]}-causal{int(causal)}-max{int(given_max)}"
    )
    return pytest.param(layout, heads, causal, dtype, given_max, scale, id=case_id)


CASES = [
    _case(layout, heads, causal, dtype, given_max=i % 4 in (0, 3), scale=0.3 if i % 5 == 0 else None)
    for i, (layout, heads, causal, dtype) in enumerate(
        product(LAYOUTS, HEADS, (False, True), (torch.float32, torch.float16))
    )
]
CASES += [
    _case(CROSS_OFFSETS, heads, True, dtype, given_max=dtype == torch.float16, scale=None)
    for heads, dtype in product(HEADS, (torch.float32, torch.float16))
]
CASES += [_case(LAYOUTS[1], HEADS[1], True, torch.bfloat16, given_max=True, scale=None)]


def _leaves(*tensors: Tensor) -> list[Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _grads(tensors: list[Tensor]) -> list[Tensor]:
    grads = [t.grad for t in tensors]
    assert all(g is not None for g in grads), "a gradient is missing"
    return [g for g in grads if g is not None]


def _run(
    fn: Any, q: Tensor, k: Tensor, v: Tensor, do: Tensor, kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Forward with lse, backward with ``do``: ``(out, lse, [dq, dk, dv])``."""
    leaves = _leaves(q, k, v)
    out, lse = fn(*leaves, **kwargs, return_lse=True)
    out.backward(do)
    return out.detach(), lse.detach(), _grads(leaves)


def _check_padding(layout: Layout, out: Tensor, lse: Tensor, grads: list[Tensor]) -> None:
    pad_q, pad_kv = ~layout.real_rows("q"), ~layout.real_rows("kv")
    assert_rows_equal(out, pad_q, 0.0, "out")
    assert_rows_equal(lse, pad_q, float("-inf"), "lse", dim=1)
    for name, grad, pad in zip(("dq", "dk", "dv"), grads, (pad_q, pad_kv, pad_kv), strict=True):
        assert_rows_equal(grad, pad, 0.0, name)


@pytest.mark.parametrize(("layout", "heads", "causal", "dtype", "given_max", "scale"), CASES)
def test_attention_matches_reference(
    layout: Layout,
    heads: tuple[int, int, int, int],
    causal: bool,
    dtype: torch.dtype,
    given_max: bool,
    scale: float | None,
) -> None:
    hq, hkv, d, dv = heads
    q, k, v, do = make_qkv(layout, hq, hkv, d, dv, dtype)
    common = {"causal": causal, "softmax_scale": scale}
    out, lse, grads = _run(
        thd.attention,
        q,
        k,
        v,
        do,
        {**layout.kwargs(max_seqlen=given_max), **common, "deterministic": hkv < hq},
    )
    ref_out, ref_lse, ref_grads = _run(reference.attention, q, k, v, do, {**layout.kwargs(), **common})
    assert out.dtype == dtype and out.shape == (layout.total_q, hq, dv)
    assert lse.dtype == torch.float32 and lse.shape == (hq, layout.total_q)
    assert_close(out, ref_out, "out", **tolerance(dtype))
    assert_close(lse, ref_lse, "lse", **tolerance(dtype))
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert got.dtype == dtype
        assert_close(got, want, name, **tolerance(dtype, "grad"))
    _check_padding(layout, out, lse, grads)


@pytest.mark.property
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=random_layouts(), causal=st.booleans(), heads=st.sampled_from(HEADS))
def test_attention_random_layouts_match_reference(
    layout: Layout, causal: bool, heads: tuple[int, int, int, int]
) -> None:
    """Random lengths, slot padding, capacity and Lq != Lk: forward and backward, fp32."""
    # Without any real query row the reference's output has no grad_fn (see the reference
    # tests); test_attention_without_real_tokens covers that case.
    assume(sum(layout.lens_q) > 0)
    hq, hkv, d, dv = heads
    q, k, v, do = make_qkv(layout, hq, hkv, d, dv, torch.float32)
    kwargs = {**layout.kwargs(), "causal": causal}
    out, lse, grads = _run(thd.attention, q, k, v, do, kwargs)
    ref_out, ref_lse, ref_grads = _run(reference.attention, q, k, v, do, kwargs)
    assert_close(out, ref_out, "out", **tolerance(torch.float32))
    assert_close(lse, ref_lse, "lse", **tolerance(torch.float32))
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(got, want, name, **tolerance(torch.float32, "grad"))
    _check_padding(layout, out, lse, grads)


def test_attention_never_reads_padding_rows() -> None:
    """NaN, +inf and zeros in the padding rows of q, k, v give bitwise identical results."""
    layout = LAYOUTS[4]
    q, k, v, do = make_qkv(layout, 2, 1, 32, 32, torch.float32)
    kwargs = {**layout.kwargs(), "causal": True}
    results = []
    for value in (float("nan"), float("inf"), 0.0):
        poisoned = [
            poison_rows(t, layout.real_rows(side), value) for t, side in ((q, "q"), (k, "kv"), (v, "kv"))
        ]
        results.append(_run(thd.attention, *poisoned, do, kwargs))
    for out, lse, grads in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
        assert all(torch.equal(g, g0) for g, g0 in zip(grads, results[0][2], strict=True))


def test_attention_backward_ignores_do_on_padding_rows() -> None:
    """An output gradient with NaN on padding rows changes no gradient (and no zero)."""
    layout = LAYOUTS[2]
    q, k, v, do = make_qkv(layout, 2, 2, 32, 32, torch.float32)
    kwargs = {**layout.kwargs(), "causal": False}
    _, _, grads = _run(thd.attention, q, k, v, do, kwargs)
    _, _, grads_nan = _run(thd.attention, q, k, v, poison_rows(do, layout.real_rows("q")), kwargs)
    for name, got, want in zip(("dq", "dk", "dv"), grads_nan, grads, strict=True):
        assert torch.equal(got, want), f"{name} changed when do's padding rows are NaN"


def test_attention_strided_views_of_packed_qkv() -> None:
    """q, k, v as views of one packed ``[T, 3, H, D]`` projection (row strides 3*H*D) work,
    give the contiguous result and send gradients into the packed tensor."""
    layout = LAYOUTS[3]
    qkv = torch.randn(layout.total_q, 3, 2, 32)
    qkv = poison_rows(qkv, layout.real_rows("q")).requires_grad_()
    do = torch.randn(layout.total_q, 2, 32)
    kwargs = {**layout.kwargs(), "causal": True}
    out = thd.attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], **kwargs)
    assert isinstance(out, Tensor), "return_lse=False must return the output tensor alone"
    out.backward(do)
    want_out, _, want_grads = _run(
        thd.attention, *(t.contiguous() for t in qkv.detach().unbind(1)), do, kwargs
    )
    assert torch.equal(out.detach(), want_out)
    assert qkv.grad is not None
    for i, name in enumerate(("dq", "dk", "dv")):
        assert torch.equal(qkv.grad[:, i], want_grads[i]), f"{name} differs for strided inputs"


@pytest.mark.parametrize("causal", [False, True], ids=["causal0", "causal1"])
def test_attention_max_seqlen_underestimate_is_still_exact(causal: bool) -> None:
    """A ``max_seqlen`` below the longest real length costs time, never correctness: each
    program walks the row blocks its grid did not cover (forward, dQ and dK/dV)."""
    layout = make_layout("long-and-short", [70, 10], pad_q=[2, 0], capacity_q=3)
    q, k, v, do = make_qkv(layout, 2, 1, 32, 32, torch.float32)
    kwargs = {**layout.kwargs(), "causal": causal}
    small = {**kwargs, "max_seqlen_q": 16, "max_seqlen_kv": 16}
    got = _run(thd.attention, q, k, v, do, small)
    want = _run(reference.attention, q, k, v, do, kwargs)
    for name, g, w in zip(("out", "lse"), got[:2], want[:2], strict=True):
        assert_close(g, w, name, **tolerance(torch.float32))
    for name, g, w in zip(("dq", "dk", "dv"), got[2], want[2], strict=True):
        assert_close(g, w, name, **tolerance(torch.float32, "grad"))


def test_rejects_bad_layout_values_when_max_seqlen_is_derived() -> None:
    """Without ``max_seqlen_*`` the device read also validates the layout (slots past T)."""
    q = k = v = torch.randn(8, 1, 32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    cup = torch.tensor([0, 4, 12], dtype=torch.int32)  # slots end at 12 > T = 8
    with pytest.raises(ThdValueError, match="cu_seqlens_padded"):
        thd.attention(q, k, v, cu, cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup)


def test_attention_max_seqlen_upper_bound() -> None:
    """``max_seqlen_*`` may be any upper bound (e.g. the buffer size, as under CUDA graphs)."""
    layout = LAYOUTS[5]
    q, k, v, do = make_qkv(layout, 2, 1, 32, 32, torch.float16)
    base = {**layout.kwargs(), "causal": True}
    loose = {**base, "max_seqlen_q": layout.total_q, "max_seqlen_kv": layout.total_kv}
    tight = _run(thd.attention, q, k, v, do, base)
    wide = _run(thd.attention, q, k, v, do, loose)
    assert torch.equal(tight[0], wide[0]) and torch.equal(tight[1], wide[1])
    assert all(torch.equal(a, b) for a, b in zip(tight[2], wide[2], strict=True))


@pytest.mark.parametrize(
    "layout",
    [
        make_layout("none", []),
        make_layout("empty", [0, 0], capacity_q=5),
        make_layout("no_queries", [0, 0], [5, 3], pad_q=[2, 1], pad_kv=[1, 0], capacity_q=3),
        make_layout("no_keys", [4, 2], [0, 0], pad_kv=[2, 0], capacity_kv=3),
    ],
    ids=lambda lay: lay.name,
)
def test_attention_without_real_tokens(layout: Layout) -> None:
    """No sequences (B = 0), only empty ones, no queries or no keys at all.

    Every max_seqlen is 0 on one side, so a grid sized by it has no programs: the zeros of
    out/dq/dk/dv and the -inf of lse must come from somewhere else.
    """
    q, k, v, do = make_qkv(layout, 2, 2, 32, 32, torch.float32)
    if layout.total_q == 0:
        q, k, v, do = (torch.randn(3, 2, 32) for _ in range(4))
    out, lse, grads = _run(thd.attention, q, k, v, do, layout.kwargs())
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((lse == float("-inf")).all())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_attention_low_level_entry_points_match_reference() -> None:
    """``attention_forward`` / ``attention_backward`` (the ring's API) against the reference."""
    layout = LAYOUTS[5]
    q, k, v, do = make_qkv(layout, 2, 1, 32, 32, torch.float32)
    kw = layout.kwargs()
    varlen = VarlenLayout(
        kw["cu_seqlens_q"],
        kw["cu_seqlens_kv"],
        kw["cu_seqlens_q_padded"],
        kw["cu_seqlens_kv_padded"],
        kw["max_seqlen_q"],
        kw["max_seqlen_kv"],
    )
    options = AttentionOptions(32**-0.5, causal=True, deterministic=True)
    out, lse = attention_forward(q, k, v, varlen, options)
    ref_out, ref_lse, ref_grads = _run(reference.attention, q, k, v, do, {**kw, "causal": True})
    assert_close(out, ref_out, "out", **tolerance(torch.float32))
    assert_close(lse, ref_lse, "lse", **tolerance(torch.float32))
    *grads, dsinks = attention_backward(do, q, k, v, out, lse, varlen, options)
    assert dsinks is None
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(got, want, name, **tolerance(torch.float32, "grad"))
    _check_padding(layout, out, lse, list(grads))


@pytest.mark.parametrize("causal", [False, True], ids=["causal0", "causal1"])
@pytest.mark.parametrize(
    "layout",
    [*LAYOUTS, CROSS_OFFSETS, make_layout("empty", [0, 0], capacity_q=3), make_layout("none", [])],
    ids=lambda lay: lay.name,
)
def test_attention_cpu_fallback_matches_reference(
    monkeypatch: pytest.MonkeyPatch, layout: Layout, causal: bool
) -> None:
    """The path CPU users get without TRITON_INTERPRET (forced by THD_ATTENTION_BACKEND).

    Forward and the flash-style backward from saved out/lse, through the autograd wiring of
    ``thd.attention``, against autograd of the reference.
    """
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    q, k, v, do = make_qkv(layout, 4, 2, 32, 64, torch.float32)
    if layout.total_q == 0:
        q, do = torch.randn(3, 4, 32), torch.randn(3, 4, 64)
        k, v = torch.randn(2, 2, 32), torch.randn(2, 2, 64)
    kwargs = {**layout.kwargs(), "causal": causal}
    out, lse, grads = _run(thd.attention, q, k, v, do, kwargs)
    if sum(layout.lens_q) == 0:  # the reference has no grad_fn then (see the reference tests)
        assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        return
    ref_out, ref_lse, ref_grads = _run(reference.attention, q, k, v, do, kwargs)
    assert_close(out, ref_out, "out", **tolerance(torch.float32))
    assert_close(lse, ref_lse, "lse", **tolerance(torch.float32))
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(got, want, name, **tolerance(torch.float32, "grad"))
    _check_padding(layout, out, lse, grads)


def test_attention_runs_triton_under_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TRITON_INTERPRET=1, CPU tensors must not fall back to the torch reference."""

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("thd.attention called the torch reference under TRITON_INTERPRET=1")

    for name in ("attention", "forward", "backward"):
        monkeypatch.setattr(reference, name, fail)
    layout = LAYOUTS[2]
    q, k, v, do = make_qkv(layout, 1, 1, 32, 32, torch.float32)
    _run(thd.attention, q, k, v, do, layout.kwargs())


def _schema_args(op: Any, values: dict[str, Any]) -> tuple[Any, ...]:
    """Positional arguments of ``op`` taken by name from ``values``."""
    names = [a.name for a in op._schema.arguments]
    missing = [n for n in names if n not in values]
    assert not missing, f"{op}: schema {names} has arguments the test does not know: {missing}"
    return tuple(values[n] for n in names)


def test_attention_custom_ops_pass_opcheck() -> None:
    """``thd::attention_fwd`` / ``thd::attention_bwd`` are correct and pass ``torch.library.opcheck``."""
    layout = make_layout("opcheck", [5, 9], pad_q=[2, 0], capacity_q=1)
    q, k, v, do = make_qkv(layout, 2, 1, 32, 32, torch.float32, poison=None)
    values = {
        "q": q,
        "k": k,
        "v": v,
        **layout.kwargs(),
        "causal": True,
        "softmax_scale": 32**-0.5,
        "sinks": None,
        "positions_q": None,
        "positions_kv": None,
        "window_size": [-1, -1],
        "softcap": 0.0,
        "deterministic": True,
    }
    fwd, bwd = torch.ops.thd.attention_fwd.default, torch.ops.thd.attention_bwd.default
    out, lse = fwd(*_schema_args(fwd, values))
    ref_out, ref_lse, ref_grads = _run(reference.attention, q, k, v, do, {**layout.kwargs(), "causal": True})
    assert_close(out, ref_out, "out", **tolerance(torch.float32))
    assert_close(lse, ref_lse, "lse", **tolerance(torch.float32))
    values |= {"do": do, "out": out, "lse": lse}
    *grads, dsinks = bwd(*_schema_args(bwd, values))
    assert dsinks.numel() == 0
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(got, want, name, **tolerance(torch.float32, "grad"))
    # The forward's autograd formula is checked with inputs that require grad; the backward
    # op has no double backward, so its inputs do not.
    grad_values = {**values, **{n: values[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}}
    torch.library.opcheck(fwd, _schema_args(fwd, grad_values))
    torch.library.opcheck(bwd, _schema_args(bwd, values))


def test_attention_compiles_without_graph_breaks() -> None:
    """``torch.compile(fullgraph=True)`` (aot_eager on CPU) gives the eager result, fwd and bwd."""
    layout = LAYOUTS[2]
    q, k, v, do = make_qkv(layout, 2, 1, 32, 32, torch.float32)
    kwargs = {**layout.kwargs(), "causal": True}

    def fn(q_: Tensor, k_: Tensor, v_: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
        return thd.attention(q_, k_, v_, **kw)  # type: ignore[return-value]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager = _run(fn, q, k, v, do, kwargs)
    got = _run(compiled, q, k, v, do, kwargs)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], eager[2], strict=True))


# ----------------------------------------------------------------------------- argument errors


def _args(
    tq: int = 8, hq: int = 2, hkv: int = 2, d: int = 32, dv: int = 32, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    return {
        "q": torch.randn(tq, hq, d, dtype=dtype),
        "k": torch.randn(8, hkv, d, dtype=dtype),
        "v": torch.randn(8, hkv, dv, dtype=dtype),
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu.clone(),
    }


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        pytest.param(
            {"cu_seqlens_q": torch.tensor([0, 3, 8])}, ThdTypeError, "cu_seqlens_q", id="cu_q-int64"
        ),
        pytest.param(
            {"cu_seqlens_kv": torch.tensor([0, 3, 8])}, ThdTypeError, "cu_seqlens_kv", id="cu_kv-int64"
        ),
        pytest.param(
            {"cu_seqlens_q_padded": torch.tensor([0, 4, 8])},
            ThdTypeError,
            "cu_seqlens_q_padded",
            id="cup_q-int64",
        ),
        pytest.param(
            {"cu_seqlens_kv": torch.tensor([0, 8], dtype=torch.int32)},
            ThdValueError,
            "cu_seqlens_kv",
            id="cu-lengths-differ",
        ),
        pytest.param(
            {"cu_seqlens_kv_padded": torch.tensor([0, 8], dtype=torch.int32)},
            ThdValueError,
            "cu_seqlens_kv_padded",
            id="cup-length-differs",
        ),
        pytest.param(_args(hq=3), ThdValueError, "heads", id="heads-indivisible"),
        pytest.param(_args(d=44), ThdValueError, "head_dim", id="head_dim-44"),
        pytest.param(_args(dv=264), ThdValueError, "head_dim", id="head_dim_v-264"),
        pytest.param({"k": torch.randn(8, 2, 32, dtype=torch.float16)}, ThdTypeError, "dtype", id="k-fp16"),
        pytest.param({"v": torch.randn(7, 2, 32)}, ThdValueError, r"\bv\b", id="v-rows"),
        pytest.param({"q": torch.randn(8, 64)}, ThdValueError, r"\bq\b", id="q-2d"),
    ],
)
def test_rejects_bad_arguments(change: dict[str, Any], error: type[Exception], match: str) -> None:
    args = {**_args(), **change}
    with pytest.raises(error, match=match):
        thd.attention(**args)
