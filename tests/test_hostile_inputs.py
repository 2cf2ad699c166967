"""Hostile and careless inputs (issue 11) through the public entry points.

NaN in real rows must propagate as PyTorch's SDPA propagates it (SDPA's math backend, one
sequence at a time, is the oracle); NaN in padding rows never. Bad arguments raise a
:class:`thd.ThdError` subclass naming the argument. CP partitioning checks its slots and never
returns uninitialised memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import thd
import thd._capture
import thd._runtime.config
from tests._helpers import (
    Layout,
    assert_close,
    assert_rows_equal,
    make_layout,
    make_qkv,
    poisoned_allocations,
)
from thd.cp import partition, partition_indices, unpartition
from thd.errors import ThdError, ThdTypeError, ThdValueError
from thd.layout import set_validation, validate
from thd.ops.lse_merge import merge_partials

SRC = Path(__file__).resolve().parents[1] / "src"
NAN = float("nan")


def _i32(values: list[int], device: str = "cpu") -> Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.fixture(autouse=True)
def _validation_on() -> Iterator[None]:
    previous = set_validation(True)
    yield
    set_validation(previous)


# ----------------------------------------------------------------------------- NaN honesty

# Three sequences with slot padding and reserved capacity; self-attention (Lq == Lk), so SDPA's
# top-left causal mask equals our bottom-right one.
LAYOUT = make_layout("nan", [5, 4, 6], pad_q=[3, 0, 2], capacity_q=2)
HQ, HKV, D = 4, 2, 32
SCALE = 0.3


def sdpa_oracle(q: Tensor, k: Tensor, v: Tensor, layout: Layout, causal: bool) -> Tensor:
    """``out`` [T, Hq, D] from SDPA's math backend, one sequence at a time; padding rows 0."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    start = 0
    for length, slot in zip(layout.lens_q, layout.slots_q, strict=True):
        rows = slice(start, start + length)
        qs, ks, vs = (t[rows].double().transpose(0, 1)[None] for t in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=SCALE, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
        start += slot
    return out


def _run(backend: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, grad: bool = False) -> tuple:
    """``thd.attention`` (out, lse[, dq, dk, dv]) on the chosen backend."""
    q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    out, lse = thd.attention(q, k, v, **LAYOUT.kwargs(), causal=causal, softmax_scale=SCALE, return_lse=True)
    if not grad:
        return out.detach(), lse
    out.backward(torch.ones_like(out))
    return out.detach(), lse, q.grad, k.grad, v.grad


# (which tensor, real row, head) -> one NaN element there. Rows are buffer rows of LAYOUT:
# sequence 0 is rows 0..4, sequence 1 rows 8..11, sequence 2 rows 12..17.
NAN_CASES = [
    pytest.param("q", 9, 1, id="q-row"),
    pytest.param("k", 8, 0, id="k-first-key"),  # every query of sequence 1 sees key 0
    pytest.param("v", 12, 1, id="v-first-key"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("which", "row", "head"), NAN_CASES)
def test_nan_in_a_real_row_propagates_as_sdpa(
    backend: str, which: str, row: int, head: int, causal: bool
) -> None:
    q, k, v, _ = make_qkv(LAYOUT, HQ, HKV, D, D, torch.float32)  # padding rows are NaN
    {"q": q, "k": k, "v": v}[which][row, head, 3] = NAN
    out, lse = _run(backend, q, k, v, causal)
    want = sdpa_oracle(q, k, v, LAYOUT, causal)
    want_nan = want.isnan()
    assert bool(want_nan.any()), "the oracle must see the NaN"
    assert torch.equal(out.isnan(), want_nan), f"{backend}: NaN pattern differs from SDPA"
    assert_close(out[~want_nan], want[~want_nan], "out (finite part)", atol=2e-4, rtol=2e-4)
    # lse depends on q and k only: NaN exactly where out is (for q/k), never for v.
    row_nan = want_nan.any(-1).t()  # [Hq, T]
    assert torch.equal(lse.isnan(), row_nan if which != "v" else torch.zeros_like(row_nan))
    pad = ~LAYOUT.real_rows("q")
    assert_rows_equal(out, pad, 0.0, "out")
    assert_rows_equal(lse, pad, float("-inf"), "lse", dim=1)


def test_nan_in_a_key_hidden_by_the_causal_mask_stays_hidden(backend: str) -> None:
    """Key 3 of sequence 0 is NaN: queries 0..2 cannot see it and keep their clean values."""
    q, k, v, _ = make_qkv(LAYOUT, HQ, HKV, D, D, torch.float32)
    clean_out, clean_lse = _run(backend, q, k, v, True)
    k[3, 0, 0] = NAN  # kv head 0 serves query heads 0 and 1
    out, lse = _run(backend, q, k, v, True)
    assert bool(out[3:5, :2].isnan().all()) and bool(lse[:2, 3:5].isnan().all())
    seen = torch.zeros(out.shape[:2], dtype=torch.bool)
    seen[3:5, :2] = True
    assert torch.equal(out[~seen], clean_out[~seen])
    assert torch.equal(lse[~seen.t()], clean_lse[~seen.t()])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nan_reaches_the_gradients_as_in_sdpa(backend: str, which: str) -> None:
    """Gradients: NaN exactly where SDPA's math backend puts it; other sequences and padding clean."""
    q, k, v, _ = make_qkv(LAYOUT, HQ, HKV, D, D, torch.float32)
    row = {"q": 9, "k": 10, "v": 11}[which]  # sequence 1 (rows 8..11)
    {"q": q, "k": k, "v": v}[which][row, 1, 0] = NAN
    _, _, dq, dk, dv = _run(backend, q, k, v, False, grad=True)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = sdpa_oracle(qd, kd, vd, LAYOUT, False)
    want.backward(torch.ones_like(want))
    seq1 = torch.zeros(LAYOUT.total_q, dtype=torch.bool)
    seq1[8:12] = True
    assert any(bool(t.isnan().any()) for t in (qd.grad, kd.grad, vd.grad)), "the oracle must see the NaN"
    for name, got, ref in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dv, vd.grad)):
        assert got is not None and ref is not None
        assert torch.equal(got.isnan(), ref.isnan()), f"{backend}: {name} NaN pattern differs from SDPA"
        assert_rows_equal(got, ~LAYOUT.real_rows("q"), 0.0, name)
        assert_close(got[~seq1], ref[~seq1], name, atol=5e-4, rtol=5e-4)


def test_nan_in_merged_partials_propagates() -> None:
    """A NaN lse in one part makes the merged row NaN (lse and out); -inf everywhere stays -inf."""
    rows, heads, dv = 6, 2, 8
    parts = [(torch.randn(rows, heads, dv), torch.randn(heads, rows)) for _ in range(3)]
    parts[1][1][0, 2] = NAN
    for i in range(3):
        parts[i][1][:, 5] = float("-inf")
        parts[i][0][5] = 0.0
    out, lse = merge_partials(parts, torch.float32)
    assert bool(lse[0, 2].isnan()) and bool(out[2, 0].isnan().all())
    nan = torch.zeros(heads, rows, dtype=torch.bool)
    nan[0, 2] = True
    assert not bool(lse[~nan].isnan().any()) and not bool(out.transpose(0, 1)[~nan].isnan().any())
    assert bool(torch.isneginf(lse[:, 5]).all()) and bool((out[5] == 0).all())


# ----------------------------------------------------------------------------- CP partitioning


def test_partition_rejects_slots_not_divisible_by_2cp() -> None:
    x = torch.arange(8.0)
    for rank in range(2):
        with pytest.raises(
            ThdValueError,
            match=r"partition: slot 0 length \(cu_seqlens_padded\[1\] - cu_seqlens_padded\[0\] = 3\): "
            r"expected a multiple of 2\*cp_size = 4",
        ):
            partition(x, _i32([0, 3, 8]), 2, rank)


def test_partition_rejects_slots_past_the_buffer() -> None:
    with pytest.raises(ThdValueError, match=r"partition: num_rows \(=8\) < cu_seqlens_padded\[-1\] \(=16\)"):
        partition(torch.arange(8.0), _i32([0, 16]), 2, 0)
    with pytest.raises(ThdValueError, match=r"partition_indices: num_rows \(=8\) < cu_seqlens_padded\[-1\]"):
        partition_indices(_i32([0, 16]), 2, 0, num_rows=8)


def test_partition_rejects_decreasing_slots() -> None:
    with pytest.raises(
        ThdValueError, match=r"partition: cu_seqlens_padded\[2\] \(=4\) < cu_seqlens_padded\[1\]"
    ):
        partition(torch.arange(8.0), _i32([0, 8, 4]), 2, 0)


def test_unpartition_rejects_bad_slots() -> None:
    shards = [torch.zeros(4), torch.zeros(4)]
    with pytest.raises(ThdValueError, match=r"unpartition: slot 0 length .* = 3\)"):
        unpartition(shards, _i32([0, 3, 8]), 2)
    with pytest.raises(
        ThdValueError, match=r"unpartition: num_rows \(=8\) < cu_seqlens_padded\[-1\] \(=16\)"
    ):
        unpartition(shards, _i32([0, 16]), 2)


@pytest.mark.parametrize("cup", [[0, 3, 8], [0, 16], [0, 8, 4], [5, 6]], ids=str)
@pytest.mark.parametrize("skip", ["validation-off", "capture"])
def test_unchecked_invalid_slots_stay_in_bounds_and_initialised(
    cup: list[int], skip: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unchecked (capture or THD_VALIDATE=0), an invalid layout gives garbage rows, never
    out-of-bounds indices or uninitialised memory (poisoned allocations would show NaN)."""
    if skip == "capture":
        monkeypatch.setattr(thd._capture, "is_capturing", lambda: True)
    else:
        set_validation(False)
    x = torch.arange(1.0, 9.0)  # no zeros and no NaN: every output value comes from x or the zero-init
    cup_t = _i32(cup)
    with poisoned_allocations():
        shards = [partition(x, cup_t, 2, r) for r in range(2)]
        back = unpartition(shards, cup_t, 2)
    for r in range(2):
        idx = partition_indices(cup_t, 2, r, num_rows=8)
        assert bool(((idx >= 0) & (idx < 8)).all()), idx
    assert shards[0].shape == (4,) and back.shape == (8,)
    assert not bool(back.isnan().any()), back
    assert bool(((back == 0) | ((back >= 1) & (back <= 8))).all()), back


def test_unpartition_of_valid_slots_writes_every_row() -> None:
    """With poisoned allocations, a valid layout round-trips exactly (the empty buffer is fully covered)."""
    x = torch.randn(24, 3)
    cup = _i32([0, 8, 8, 16])
    with poisoned_allocations():
        back = unpartition([partition(x, cup, 2, r) for r in range(2)], cup, 2)
    assert torch.equal(back, x)


@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        pytest.param(
            torch.tensor(1.0), ThdValueError, r"partition: x shape: expected \[T, \.\.\.\]", id="0-d"
        ),
        pytest.param(
            [1.0, 2.0], ThdTypeError, r"partition: x: expected a torch\.Tensor, got list", id="list"
        ),
    ],
)
def test_partition_rejects_non_buffers(x: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        partition(x, _i32([0, 4]), 2, 0)  # type: ignore[arg-type]


def test_unpartition_rejects_non_tensor_shards() -> None:
    cup = _i32([0, 4])
    with pytest.raises(ThdTypeError, match=r"unpartition: shards\[1\]: expected a torch\.Tensor, got list"):
        unpartition([torch.zeros(2), [0.0, 0.0]], cup, 2)  # type: ignore[list-item]
    with pytest.raises(ThdTypeError, match=r"unpartition: shards: expected a sequence of tensors, got int"):
        unpartition(3, cup, 2)  # type: ignore[arg-type]
    with pytest.raises(ThdValueError, match=r"unpartition: shards\[1\]: expected dtype torch\.float32"):
        unpartition([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], cup, 2)


def test_partition_propagates_meta_shapes() -> None:
    x = torch.empty(16, 3, device="meta")
    cup = torch.empty(3, dtype=torch.int32, device="meta")
    shard = partition(x, cup, 2, 1)
    assert shard.shape == (8, 3) and shard.is_meta
    assert unpartition([shard, shard], cup, 2).shape == (16, 3)
    with pytest.raises(ThdValueError, match="partition_indices: num_rows: expected an int with a meta"):
        partition_indices(cup, 2, 0)


# ----------------------------------------------------------------------------- merge_partials


def test_merge_partials_rejects_bad_parts() -> None:
    out, lse = torch.zeros(4, 2, 8), torch.zeros(2, 4)
    with pytest.raises(
        ThdValueError, match=r"merge_partials: parts: expected a non-empty sequence .* got 0 parts"
    ):
        merge_partials([], torch.float32)
    with pytest.raises(ThdTypeError, match=r"merge_partials: parts\[1\]: expected an \(out, lse\) pair"):
        merge_partials([(out, lse), out], torch.float32)  # type: ignore[list-item]
    with pytest.raises(ThdValueError, match=r"merge_partials: parts\[0\] lse: expected float32"):
        merge_partials([(out, lse.t())], torch.float32)
    with pytest.raises(ThdValueError, match=r"merge_partials: parts\[1\]: expected out \[4, 2, 8\]"):
        merge_partials([(out, lse), (out[:3], lse[:, :3])], torch.float32)
    with pytest.raises(ThdTypeError, match=r"merge_partials: dtype: expected a floating torch\.dtype"):
        merge_partials([(out, lse)], torch.int32)


# ----------------------------------------------------------------------------- layout and meta


def test_validate_names_int64_and_refuses_meta_values() -> None:
    with pytest.raises(
        ThdTypeError, match=r"validate: cu_seqlens dtype: expected torch\.int32, got torch\.int64"
    ):
        validate(torch.tensor([0, 3]))
    meta = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(ThdValueError, match=r"validate: cu_seqlens device: .*got meta"):
        validate(meta, meta, num_rows=8, cp_size=2)  # nothing to validate: not a silent pass
    with pytest.raises(ThdTypeError, match="cu_seqlens_padded dtype"):
        validate(meta, torch.empty(3, dtype=torch.int64, device="meta"))


def test_attention_on_meta_tensors_propagates_shapes_or_raises_thd_error() -> None:
    """Meta tensors either work (shapes only) or get a ThdError, never NotImplementedError."""
    q = torch.empty(16, 4, 32, device="meta")
    kv = torch.empty(16, 2, 32, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    try:
        out, lse = thd.attention(q, kv, kv, cu, cu, max_seqlen_q=8, max_seqlen_kv=8, return_lse=True)
    except ThdError as exc:
        assert "meta" in str(exc), exc
        return
    assert out.is_meta and out.shape == (16, 4, 32) and lse.shape == (4, 16)


def test_reference_on_meta_tensors_propagates_shapes() -> None:
    q = torch.empty(16, 4, 32, device="meta", requires_grad=True)
    kv = torch.empty(16, 2, 32, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = thd.reference.attention(q, kv, kv, cu, cu, causal=True, return_lse=True)
    assert out.is_meta and out.shape == (16, 4, 32) and lse.shape == (4, 16)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    with pytest.raises(ThdValueError, match="meta tensors hold no lengths"):
        thd.reference.attention(
            torch.zeros(16, 4, 32), torch.zeros(16, 2, 32), torch.zeros(16, 2, 32), cu, cu
        )


# ----------------------------------------------------------------------------- attention arguments


def _args(**change: Any) -> dict[str, Any]:
    cu = _i32([0, 3, 8])
    args = {
        "q": torch.randn(8, 2, 32),
        "k": torch.randn(8, 2, 32),
        "v": torch.randn(8, 2, 32),
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu.clone(),
    }
    return {**args, **change}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        pytest.param(
            {"k": torch.randn(8, 2, 32, device="meta")}, ThdValueError, r"\bk device", id="k-device"
        ),
        pytest.param(
            {"v": torch.randn(8, 2, 32, device="meta")}, ThdValueError, r"\bv device", id="v-device"
        ),
        pytest.param({"max_seqlen_q": -5}, ThdValueError, r"max_seqlen_q.*-5", id="max_q-negative"),
        pytest.param({"max_seqlen_q": 3.7}, ThdTypeError, r"max_seqlen_q.*3\.7", id="max_q-float"),
        pytest.param({"max_seqlen_q": "x"}, ThdTypeError, r"max_seqlen_q.*'x'", id="max_q-str"),
        pytest.param(
            {"max_seqlen_kv": torch.tensor(5)}, ThdTypeError, r"max_seqlen_kv.*Tensor", id="max_kv-tensor"
        ),
        pytest.param({"max_seqlen_kv": True}, ThdTypeError, r"max_seqlen_kv.*True", id="max_kv-bool"),
        pytest.param({"softmax_scale": "x"}, ThdTypeError, r"softmax_scale.*'x'", id="scale-str"),
        pytest.param({"softmax_scale": NAN}, ThdValueError, r"softmax_scale.*nan", id="scale-nan"),
        pytest.param(
            {"softmax_scale": torch.tensor(0.5)}, ThdTypeError, r"softmax_scale.*Tensor", id="scale-tensor"
        ),
        pytest.param(
            {"q": torch.randn(8, 2, 12), "k": torch.randn(8, 2, 12), "v": torch.randn(8, 2, 12)},
            ThdValueError,
            r"head_dim.*multiple of 8.*got 12",
            id="head_dim-12",
        ),
    ],
)
def test_attention_rejects_hostile_arguments(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        thd.attention(**_args(**change))


def test_attention_accepts_numpy_max_seqlen_and_int_scale() -> None:
    out = thd.attention(**_args(max_seqlen_q=np.int64(5), max_seqlen_kv=np.int32(5), softmax_scale=1))
    assert out.shape == (8, 2, 32) and bool(torch.isfinite(out).all())


# ----------------------------------------------------------------------------- import graph


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        check=False,
    )


def test_ring_plan_op_does_not_load_the_ring() -> None:
    done = _python(
        "import sys, thd.ops.ring_plan; "
        "print(sorted(m for m in sys.modules if m == 'thd.cp' or m.startswith('thd.cp.')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("module", ["thd.ops.zero_padding", "thd.padding", "thd.ops.ring_plan", "thd.cp"])
def test_modules_import_standalone(module: str) -> None:
    done = _python(f"import {module}")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("entry", ["attention_forward", "attention_backward"])
def test_low_level_entry_points_reject_int64_offsets(entry: str) -> None:
    """The exported low-level entry points check the layout tensors like ``thd.attention``."""
    from thd.ops import attention as ops
    from thd.ops.attention.params import AttentionOptions, VarlenLayout

    cu64 = torch.tensor([0, 3, 8])
    layout = VarlenLayout(cu64, cu64.clone(), max_seqlen_q=5, max_seqlen_kv=5)
    q = k = v = torch.randn(8, 2, 32)
    args: tuple[Any, ...] = (q, k, v, layout, AttentionOptions(softmax_scale=0.2))
    if entry == "attention_backward":
        args = (torch.randn(8, 2, 32), q, k, v, torch.randn(8, 2, 32), torch.zeros(2, 8), *args[3:])
    with pytest.raises(ThdTypeError, match=rf"{entry}: cu_seqlens_q dtype: expected torch\.int32"):
        getattr(ops, entry)(*args)
