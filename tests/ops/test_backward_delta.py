"""``backward_delta`` and ``BackwardCall.delta``: ``rowsum(dO * out)`` computed once and shared.

The oracle for the delta is a float64 row sum over the real rows, taken here; for the gradients it
is the same backward call computing its own preprocess. Runs the Triton kernels through the
interpreter on CPU (tiny shapes) and on a GPU under the ``gpu`` marker.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor

from tests._helpers import Layout, make_layout, make_qkv, poison_rows
from thd.errors import ThdValueError
from thd.ops.attention import AttentionOptions, SavedForBackward, VarlenLayout, backward_call, reference
from thd.ops.attention.dispatch import backward_delta
from thd.ops.attention.params import BackwardCall, ForwardCall

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CUDA = torch.cuda.is_available()


def _devices() -> list[object]:
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs CUDA")]),
    ]


def _layout(device: str) -> Layout:
    if device == "cpu":  # a zero-length sequence, padding between sequences and spare rows
        return make_layout("delta", [9, 0, 21, 4], pad_q=[3, 2, 0, 5], capacity_q=3)
    return make_layout("delta", [700, 0, 2049, 1300, 64], pad_q=[4, 8, 0, 12, 3], capacity_q=5)


def _varlen(layout: Layout, device: str) -> VarlenLayout:
    names = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
             "max_seqlen_kv")  # fmt: skip
    args = layout.kwargs(device)
    return VarlenLayout(*(args[name] for name in names))


def _problem(
    device: str, dtype: torch.dtype, sinks: bool = False, deterministic: bool = True
) -> tuple[Layout, BackwardCall]:
    """A backward call whose ``do`` and ``out`` hold NaN on every padding row (``deterministic``:
    dQ from its own kernel, so two runs agree bitwise; else added by atomics on a GPU)."""
    layout = _layout(device)
    dim = 32 if device == "cpu" else 128
    gen = torch.Generator(device=device).manual_seed(11)
    q, k, v, do = make_qkv(layout, 4, 2, dim, dim, dtype, device, generator=gen)
    varlen = _varlen(layout, device)
    options = AttentionOptions(dim**-0.5, causal=True, deterministic=deterministic)
    sink = torch.randn(4, generator=gen, device=device).to(dtype) if sinks else None
    out, lse = reference.forward(ForwardCall(q, k, v, varlen, options, sink))
    real = layout.real_rows("q", device)
    do, out = poison_rows(do, real), poison_rows(out, real)
    return layout, BackwardCall(do, SavedForBackward(q, k, v, out, lse, sink), varlen, options)


def _want(layout: Layout, call: BackwardCall) -> tuple[Tensor, Tensor]:
    """The float64 row sums on real rows (``[H, rows]``) and the real-row mask."""
    real = layout.real_rows("q", call.do.device)
    sums = (call.do.double() * call.saved.out.double()).sum(-1).transpose(0, 1)
    return sums[:, real], real


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delta_is_the_row_sum_on_real_rows_without_reading_padding(device: str, dtype: torch.dtype) -> None:
    layout, call = _problem(device, dtype)
    delta = backward_delta(call)
    want, real = _want(layout, call)
    assert delta.dtype == torch.float32 and delta.shape == call.saved.lse.shape
    got = delta[:, real].double()
    assert torch.isfinite(got).all(), "a real row read NaN from padding"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_a_shared_delta_gives_the_gradients_of_the_call_own_preprocess(
    device: str, sinks: bool, deterministic: bool
) -> None:
    _, call = _problem(device, torch.bfloat16, sinks, deterministic)
    own = backward_call(call)
    shared = backward_call(call._replace(delta=backward_delta(call)))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), own, shared, strict=True):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        # On a GPU the shared delta comes from the tl preprocess while a Gluon backward's own comes
        # from its kernel (sums in another order); dQ by atomics adds in any order.
        if device == "cuda" or (name == "dq" and not deterministic):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        else:
            assert torch.equal(a, b), f"{name}: differs with the shared delta"


@pytest.mark.parametrize("device", _devices())
def test_the_given_delta_is_what_the_kernels_read(device: str) -> None:
    """A wrong delta changes dQ and dK (so the kernels read it and skip their own preprocess);
    with sinks the call runs its own preprocess and the wrong delta changes nothing."""
    layout, call = _problem(device, torch.float32)
    wrong = backward_delta(call) + 1.0
    right = backward_call(call)
    changed = backward_call(call._replace(delta=wrong))
    real = layout.real_rows("q", device)
    assert not torch.allclose(right[0][real], changed[0][real]), "dq ignored the given delta"
    assert torch.equal(right[2], changed[2]), "dv does not depend on delta"
    _, with_sinks = _problem(device, torch.float32, sinks=True)
    own = backward_call(with_sinks)
    ignored = backward_call(with_sinks._replace(delta=backward_delta(with_sinks) + 1.0))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), own, ignored, strict=True):
        assert torch.equal(a, b), f"{name}: a call with sinks used the given delta"


@pytest.mark.parametrize(
    "make_bad",
    [
        pytest.param(lambda lse: torch.zeros(lse.shape[0], lse.shape[1] + 1), id="shape"),
        pytest.param(lambda lse: torch.zeros(lse.shape, dtype=torch.float64), id="dtype"),
        pytest.param(lambda lse: torch.zeros(lse.shape[1], lse.shape[0]).t(), id="strides"),
    ],
)
def test_a_delta_unlike_lse_is_refused(make_bad) -> None:  # type: ignore[no-untyped-def]
    _, call = _problem("cpu", torch.float32)
    bad = make_bad(call.saved.lse)
    with pytest.raises(ThdValueError, match="delta must be contiguous float32 shaped like lse"):
        backward_call(call._replace(delta=bad))
