"""Invalid layouts where thd does not validate, and the last hostile arguments of issue 23.

With both ``max_seqlen_*`` given ``thd.attention`` does not validate the layout. The kernels
then clamp every row span to the buffer (``start = clamp(slot start, 0, T)``,
``length = clamp(L, 0, T - start)``); the torch reference clamps the same way. Oracle: the same
call on the valid layout those clamped spans describe, written out by hand per case. Where the
clamped spans overlap another slot's padding the kernels' result depends on program order, so
those cases are checked on the reference only, and on the kernels for "no exception, finite".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import thd
import thd._runtime.config
from thd.cp import partition, unpartition
from thd.errors import ThdTypeError, ThdValueError
from thd.layout import pack_lengths, set_validation, validate
from thd.ops.attention import AttentionOptions, VarlenLayout, attention_backward, attention_forward

ROWS = 16
I32_MAX = 2**31 - 1


def _i32(values: list[int] | None) -> Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.int32)


# name -> (cu, cup, clamped-equivalent cu, cup, whether the kernels' result is order-free)
CASES = {
    "decreasing-cu": ([0, 5, 3], [0, 8, 16], [0, 5, 5], [0, 8, 16], True),
    "decreasing-unpadded": ([0, 8, 4], None, [0, 8, 8], None, False),  # tail [4, 16) overlaps row 4..7
    "slots-past-buffer": ([0, 3, 6], [0, 20, 40], [0, 3, 3], [0, 16, 16], True),
    "negative-slot": ([0, 3, 6], [-5, 4, 8], [0, 3, 6], [0, 4, 8], True),
    "near-int32-max": ([0, I32_MAX, I32_MAX], None, [0, ROWS, ROWS], None, True),  # did not return in 30 s
    "int32-overflowing-length": ([0, I32_MAX, -(2**31)], None, [0, ROWS, ROWS], None, False),
}


def _attention(q: Tensor, k: Tensor, v: Tensor, cu: list[int], cup: list[int] | None, causal: bool) -> tuple:
    """out, lse, dq, dk, dv with both bounds given (the unvalidated path)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    c, p = _i32(cu), _i32(cup)
    out, lse = thd.attention(
        q, k, v, c, c, cu_seqlens_q_padded=p, cu_seqlens_kv_padded=p, max_seqlen_q=4, max_seqlen_kv=4,
        causal=causal, return_lse=True,
    )  # fmt: skip
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return (out.detach(), lse, *grads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(CASES))
def test_invalid_layout_gives_the_clamped_layouts_values(backend: str, name: str, causal: bool) -> None:
    cu, cup, want_cu, want_cup, order_free = CASES[name]
    q, k, v = (torch.randn(ROWS, 2, 8) for _ in range(3))
    got = _attention(q, k, v, cu, cup, causal)
    if backend == "triton" and not order_free:
        assert all(bool(torch.isfinite(t).all()) for t in (got[0], *got[2:])), "garbage, but finite"
        return
    validate(_i32(want_cu), _i32(want_cup), num_rows=ROWS)  # the oracle's layout is a valid one
    want = _attention(q, k, v, want_cu, want_cup, causal)
    for label, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want, strict=True):
        assert torch.equal(a, b), f"{name} ({backend}): {label} differs from the clamped layout's"


def test_reference_low_level_forward_clamps_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attention_forward`` (the ring's entry point) on the reference, with cross lengths."""
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    q, k, v = torch.randn(ROWS, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    bad = VarlenLayout(_i32([0, 9, 2**30]), _i32([0, 4, -7]), max_seqlen_q=9, max_seqlen_kv=4)
    good = VarlenLayout(_i32([0, 9, 16]), _i32([0, 4, 4]), max_seqlen_q=9, max_seqlen_kv=4)
    options = AttentionOptions(0.3, causal=True)
    for a, b in zip(
        attention_forward(q, k, v, bad, options), attention_forward(q, k, v, good, options), strict=True
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("contiguous", [True, False], ids=["kernel", "masked"])  # kernel: interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_padding_ops_on_invalid_layouts_zero_whole_rows_and_nothing_else(name: str, contiguous: bool) -> None:
    """``thd.padding`` never validates values: garbage rows, never an exception or a write outside
    ``x`` (canary rows around it; the strided view's other column)."""
    cu, cup, *_ = CASES[name]
    buf = torch.arange(1.0, 1 + (ROWS + 2) * 2 * 2).view(ROWS + 2, 2, 2)  # no zeros: a zero was written
    x = buf[1:-1, 0] if contiguous else buf[1:-1, :, 0]  # [ROWS, 2]: contiguous rows, or strided
    before, outside = buf.clone(), torch.ones_like(buf, dtype=torch.bool)
    (outside[1:-1, 0] if contiguous else outside[1:-1, :, 0]).fill_(False)
    thd.padding.zero_padding_(x, _i32(cu), _i32(cup))
    assert torch.equal(buf[outside], before[outside]), "a write outside x"
    zeroed = (x == 0).all(1)
    x_before = before[1:-1, 0] if contiguous else before[1:-1, :, 0]
    assert torch.equal(x[~zeroed], x_before[~zeroed]), "a row was changed without being zeroed"
    rows = thd.padding.valid_rows(_i32(cu), _i32(cup), ROWS)
    assert rows.dtype == torch.bool and rows.shape == (ROWS,)


# ----------------------------------------------------------------------------- low-level backward


def _saved(change: str) -> dict[str, Any]:
    """Arguments of ``attention_backward`` with one saved tensor replaced by a wrong one."""
    q, k, v = (torch.randn(ROWS, 2, 8) for _ in range(3))
    cu = _i32([0, 5, ROWS])
    layout, options = VarlenLayout(cu, cu, max_seqlen_q=11, max_seqlen_kv=11), AttentionOptions(0.3)
    out, lse = attention_forward(q, k, v, layout, options)
    args = {"do": torch.ones_like(out), "q": q, "k": k, "v": v, "out": out, "lse": lse}
    wrong = {
        "do-rows": ("do", torch.ones(4, 2, 8)),
        "out-rows": ("out", out[:4]),
        "lse-rows": ("lse", lse[:, :4]),
        "lse-transposed": ("lse", lse.t()),
        "lse-half": ("lse", lse.half()),
        "do-int": ("do", torch.ones(ROWS, 2, 8, dtype=torch.int32)),
        "out-meta": ("out", out.to("meta")),
    }[change]
    return {**args, wrong[0]: wrong[1], "layout": layout, "options": options}


@pytest.mark.parametrize(
    "change", ["do-rows", "out-rows", "lse-rows", "lse-transposed", "lse-half", "do-int", "out-meta"]
)
def test_backward_checks_its_saved_tensors(backend: str, change: str) -> None:
    """``do``/``out``/``lse`` index q's rows in the kernels: a wrong shape corrupted the interpreter's
    heap (``free(): invalid next size``) and raised RuntimeError on the reference."""
    args = _saved(change)
    name = change.split("-")[0]
    with pytest.raises(ThdValueError, match=rf"attention_backward: {name}( device)?: expected"):
        attention_backward(**args)


# ----------------------------------------------------------------------------- head dim 0, q rank


@pytest.mark.parametrize(
    ("q", "kwargs", "match"),
    [
        pytest.param(torch.randn(4, 2, 0), {}, r"attention: q/k head_dim: .*got 0", id="D=0"),
        pytest.param(torch.randn(4, 2, 0), {"softmax_scale": 1.0}, r"q/k head_dim: .*got 0", id="D=0-scaled"),
        pytest.param(torch.tensor(1.0), {}, r"attention: q shape: expected \[T, H, D\], got \[\]", id="0-d"),
        pytest.param(torch.randn(2, 4, 2, 8), {}, r"attention: q shape: .*got \[2, 4, 2, 8\]", id="4-d"),
    ],
)
def test_attention_shape_errors_are_thd_errors(q: Tensor, kwargs: dict[str, Any], match: str) -> None:
    kv = torch.randn(4, 2, q.shape[-1] if q.dim() == 3 else 8)
    cu = _i32([0, 4])
    with pytest.raises(ThdValueError, match=match):
        thd.attention(q, kv, kv, cu, cu, **kwargs)


# ----------------------------------------------------------------------------- meta offsets

META = torch.empty(3, dtype=torch.int32, device="meta")


@pytest.mark.parametrize("enabled", [True, False], ids=["validation-on", "validation-off"])
def test_validate_refuses_meta_offsets(enabled: bool) -> None:
    previous = set_validation(enabled)
    try:
        with pytest.raises(
            ThdValueError, match=r"validate: cu_seqlens device: expected a device holding values, got meta"
        ):
            validate(META)
        with pytest.raises(ThdValueError, match=r"validate: cu_seqlens device: .*got meta"):
            validate(META, META.clone(), num_rows=8)
    finally:
        set_validation(previous)


def test_partition_refuses_meta_slots_for_real_rows() -> None:
    with pytest.raises(ThdValueError, match=r"partition: cu_seqlens_padded device: .*got meta"):
        partition(torch.arange(8.0), META, 2, 0)
    with pytest.raises(ThdValueError, match=r"unpartition: cu_seqlens_padded device: .*got meta"):
        unpartition([torch.zeros(4), torch.zeros(4)], META, 2)
    shard = partition(torch.empty(8, device="meta"), META, 2, 0)  # meta rows: shapes only, as before
    assert shard.is_meta and shard.shape == (4,)


# ----------------------------------------------------------------------------- pack_lengths


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param(
            {"lengths": [2**31]}, ThdValueError, r"at most 2147483647 rows .*got 2147483648", id="one-huge"
        ),
        pytest.param(
            {"lengths": [2**30, 2**30]}, ThdValueError, r"lengths: expected slots totalling", id="sum"
        ),
        pytest.param(
            {"lengths": [3], "pad_multiple": 2**31}, ThdValueError, r"got 2147483648 .*pad_multiple", id="pad"
        ),
        pytest.param(
            {"lengths": [3, 1.5]}, ThdTypeError, r"lengths\[1\]: expected an int, got float 1\.5", id="float"
        ),
        pytest.param(
            {"lengths": [True]}, ThdTypeError, r"lengths\[0\]: expected an int, got bool", id="bool"
        ),
        pytest.param({"lengths": ["3"]}, ThdTypeError, r"lengths\[0\]: expected an int, got str", id="str"),
        pytest.param(
            {"lengths": None}, ThdTypeError, r"lengths: expected a sequence of ints, got NoneType", id="none"
        ),
        pytest.param(
            {"lengths": "12"}, ThdTypeError, r"lengths: expected a sequence of ints, got str", id="string"
        ),
        pytest.param(
            {"lengths": [torch.tensor([1, 2])]},
            ThdTypeError,
            r"lengths\[0\]: expected an int, got Tensor",
            id="tensor",
        ),
    ],
)
def test_pack_lengths_refuses_lengths_it_cannot_pack(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Over int32 is refused before any allocation (``[2**31]`` used to allocate a 16 GiB index)."""
    with pytest.raises(error, match=match):
        pack_lengths(**kwargs)


def test_pack_lengths_takes_numpy_and_tensor_ints() -> None:
    layout = pack_lengths([np.int64(3), torch.tensor(2), 4], pad_multiple=4)
    assert layout.lengths == (3, 2, 4) and layout.cu_seqlens_padded.tolist() == [0, 4, 8, 12]
    assert pack_lengths(torch.tensor([5, 0, 1])).cu_seqlens.tolist() == [0, 5, 5, 6]
