"""``thd.attention`` on a CUDA GPU (``make test-gpu``): realistic sizes against the fp32 reference.

Covers every head dim, bf16/fp16, GQA/MQA, ``Dv != D``, padding layouts, cross attention,
bitwise determinism, ``torch.compile(fullgraph=True)``, CUDA-graph capture and replay with new
``cu_seqlens`` values, no host sync when ``max_seqlen_*`` are given, and 64-bit row offsets.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
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
)
from thd.errors import ThdValueError
from thd.ops.attention import reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
TOL = 2.5e-2  # bf16/fp16 against the fp32 reference, as the peers' varlen tests use


def _random_layout(
    name: str, seed: int, count: int, lo: int, hi: int, *, multiple: int = 1, capacity: int = 0
) -> Layout:
    """``count`` random lengths in ``[lo, hi]``, each slot padded up to a multiple of ``multiple``."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(count)]
    return make_layout(name, lens, pad_q=[-n % multiple for n in lens], capacity_q=capacity)


DOCS = _random_layout("docs", 0, 8, 1, 1024, multiple=64, capacity=77)
PACKED = _random_layout("packed", 1, 5, 100, 1500)
SHORT = make_layout("short", [1, 0, 1, 3, 0, 64, 1, 129, 0], pad_q=[0, 2, 1, 1, 0, 0, 7, 0, 3], capacity_q=5)
CROSS = make_layout(
    "cross",
    [300, 1, 0, 700, 65],
    [100, 0, 90, 900, 65],
    pad_q=[4, 0, 16, 3, 0],
    pad_kv=[0, 8, 1, 5, 63],
    capacity_q=9,
    capacity_kv=0,
)


def _case(layout: Layout, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, causal: bool) -> Any:
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    case_id = (
        f"{layout.name}-T{layout.total_q}x{layout.total_kv}-H{hq}x{hkv}-D{d}x{dv}-{dt}-causal{int(causal)}"
    )
    return pytest.param(layout, hq, hkv, d, dv, dtype, causal, id=case_id)


CAUSAL = (False, True)
BF16, FP16 = torch.bfloat16, torch.float16
# Each (D, Dv, dtype, causal, Hq/Hkv) combination costs a full autotuning sweep (about 17
# kernel compiles) on a fresh machine, so the matrix varies one thing at a time around
# "GQA 8:2, bf16, causal" instead of taking the full product.
CASES = (
    [_case(DOCS, 8, 2, d, d, BF16, True) for d in HEAD_DIMS]  # every head dim
    + [_case(DOCS, 8, 2, d, d, BF16, False) for d in (64, 128)]
    + [_case(DOCS, 8, 2, 128, 128, FP16, True)]
    + [_case(DOCS, 8, 2, 192, 128, BF16, True), _case(DOCS, 8, 2, 128, 64, BF16, False)]  # Dv != D
    + [_case(DOCS, 8, 1, 128, 128, BF16, True), _case(DOCS, 4, 4, 128, 128, BF16, True)]  # MQA, MHA
    + [_case(lay, 8, 2, 128, 128, BF16, c) for lay in (PACKED, SHORT, CROSS) for c in CAUSAL]
)


def _fwd_bwd(fn: Any, inputs: list[Tensor], do: Tensor, kwargs: dict[str, Any]) -> list[Tensor]:
    """``[out, lse, dq, dk, dv]`` of ``fn`` on fresh leaves made from ``inputs``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves, **kwargs, return_lse=True)
    out.backward(do)
    grads = [t.grad for t in leaves]
    assert all(g is not None for g in grads)
    return [out.detach(), lse.detach(), *(g for g in grads if g is not None)]


def _check_padding(layout: Layout, results: list[Tensor]) -> None:
    pad_q, pad_kv = ~layout.real_rows("q", DEVICE), ~layout.real_rows("kv", DEVICE)
    out, lse, dq, dk, dv = results
    assert_rows_equal(out, pad_q, 0.0, "out")
    assert_rows_equal(lse, pad_q, float("-inf"), "lse", dim=1)
    for name, grad, pad in (("dq", dq, pad_q), ("dk", dk, pad_kv), ("dv", dv, pad_kv)):
        assert_rows_equal(grad, pad, 0.0, name)


@pytest.mark.parametrize(("layout", "hq", "hkv", "d", "dv", "dtype", "causal"), CASES)
def test_attention_gpu_matches_reference(
    layout: Layout, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, causal: bool
) -> None:
    q, k, v, do = make_qkv(layout, hq, hkv, d, dv, dtype, DEVICE)
    kwargs = {**layout.kwargs(DEVICE), "causal": causal}
    got = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    # The reference runs in fp32 on the same (rounded) inputs.
    want = _fwd_bwd(reference.attention, [q.float(), k.float(), v.float()], do.float(), kwargs)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        # Gradients can exceed 1: their absolute tolerance scales with the tensor's size.
        scale = 1.0 if name in ("out", "lse") else max(1.0, float(w.abs().max()))
        assert_close(g.float(), w, name, atol=TOL * scale, rtol=TOL)
    _check_padding(layout, got)


@pytest.mark.parametrize("causal", CAUSAL, ids=["causal0", "causal1"])
def test_attention_gpu_deterministic_is_bitwise_repeatable(causal: bool) -> None:
    """Repeated calls agree bitwise; fresh allocations hold NaN, so unwritten rows cannot agree."""
    q, k, v, do = make_qkv(DOCS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    kwargs = {**DOCS.kwargs(DEVICE), "causal": causal, "deterministic": True}
    with poisoned_allocations():
        first = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    _check_padding(DOCS, first)
    for _ in range(3):
        again = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), again, first, strict=True):
            assert torch.equal(a, b), f"{name} differs between repeated deterministic calls"


class _Attention(torch.nn.Module):
    """A module whose forward calls ``thd.attention`` with fixed layout buffers."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        kwargs = layout.kwargs(DEVICE)
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            self.register_buffer(name, kwargs[name])
        self.max_seqlen_q: int = kwargs["max_seqlen_q"]
        self.max_seqlen_kv: int = kwargs["max_seqlen_kv"]

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return thd.attention(  # type: ignore[return-value]
            q,
            k,
            v,
            self.cu_seqlens_q,
            self.cu_seqlens_kv,
            cu_seqlens_q_padded=self.cu_seqlens_q_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_kv_padded,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_kv=self.max_seqlen_kv,
            causal=True,
            return_lse=True,
        )


def test_attention_gpu_torch_compile_fullgraph() -> None:
    q, k, v, do = make_qkv(DOCS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    module = _Attention(DOCS)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    eager = _fwd_bwd(lambda *a, return_lse: module(*a), [q, k, v], do, {})
    got = _fwd_bwd(lambda *a, return_lse: compiled(*a), [q, k, v], do, {})
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, eager, strict=True):
        assert torch.equal(a, b), f"{name}: compiled result differs from eager"


# Same number of sequences (cu shapes) and buffer size, different boundaries: slot padding,
# none, zero-length and one-token sequences, reserved capacity of different sizes.
_GRAPH_ROWS = 2048
_GRAPH_LAYOUTS = [
    make_layout("g0", [300, 5, 700, 1, 0, 420], pad_q=[4, 59, 0, 3, 8, 1], capacity_q=547),
    make_layout("g1", [1000, 0, 0, 1, 640, 333], pad_q=0, capacity_q=74, padded=True),
    make_layout("g2", [1, 1, 1, 2045, 0, 0], pad_q=0, padded=True),
    make_layout("g3", [64, 128, 256, 512, 33, 7], pad_q=[0, 64, 0, 1, 31, 9], capacity_q=943),
]


@pytest.mark.parametrize("captured", [0, 2], ids=["capture-slot-padded", "capture-unpadded"])
def test_attention_gpu_cuda_graph_replay_with_new_cu_seqlens(captured: int) -> None:
    """Capture forward+backward once, replay with other cu_seqlens values: equal to eager, bitwise.

    Captured on a layout with slot padding, or on one without (``cup == cu`` by value), then
    replayed on all others: a padding decision taken on the host at capture time would leave
    the later layouts' slot padding unzeroed.
    """
    assert all(lay.total_q == _GRAPH_ROWS for lay in _GRAPH_LAYOUTS)
    hq, hkv, d = 8, 2, 128
    first = _GRAPH_LAYOUTS[captured]
    static = first.kwargs(DEVICE, max_seqlen=False)
    bounds = {"max_seqlen_q": _GRAPH_ROWS, "max_seqlen_kv": _GRAPH_ROWS}
    call_kwargs = {**static, **bounds, "causal": True, "deterministic": True}
    q, k, v, do = (t.detach().clone() for t in make_qkv(first, hq, hkv, d, d, torch.bfloat16, DEVICE))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> tuple[Tensor, Tensor]:
        out, lse = thd.attention(*leaves, **call_kwargs, return_lse=True)
        out.backward(do)
        return out, lse

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: autotuning and allocator pools, outside capture
            step()
            for t in leaves:
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = step()
    static_grads = [t.grad for t in leaves]

    for layout in _GRAPH_LAYOUTS[captured + 1 :] + _GRAPH_LAYOUTS[: captured + 1]:
        new_q, new_k, new_v, new_do = make_qkv(layout, hq, hkv, d, d, torch.bfloat16, DEVICE)
        new_kwargs = layout.kwargs(DEVICE, max_seqlen=False)
        with torch.no_grad():
            for dst, src in zip((q, k, v, do), (new_q, new_k, new_v, new_do), strict=True):
                dst.copy_(src)
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                static[name].copy_(new_kwargs[name])
        graph.replay()
        torch.cuda.synchronize()
        eager = _fwd_bwd(
            thd.attention, [new_q, new_k, new_v], new_do, {**new_kwargs, **bounds, "causal": True}
        )
        replayed = [static_out, static_lse, *static_grads]
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), replayed, eager, strict=True):
            assert a is not None
            assert torch.equal(a, b), f"{layout.name}: replayed {name} differs from eager"
        _check_padding(layout, [t for t in replayed if t is not None])


def test_attention_gpu_rejects_capture_without_max_seqlen() -> None:
    q, k, v, _ = make_qkv(DOCS, 4, 4, 64, 64, torch.bfloat16, DEVICE, poison=0.0)
    kwargs = DOCS.kwargs(DEVICE, max_seqlen=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ThdValueError, match="max_seqlen"), torch.cuda.graph(graph):
        thd.attention(q, k, v, **kwargs, causal=True)


def test_attention_gpu_no_host_sync_with_max_seqlen() -> None:
    q, k, v, do = make_qkv(DOCS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    kwargs = {**DOCS.kwargs(DEVICE), "causal": True}
    _fwd_bwd(thd.attention, [q, k, v], do, kwargs)  # warm-up: autotuning synchronizes
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _lse = thd.attention(*leaves, **kwargs, return_lse=True)
        out.backward(do)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_attention_gpu_rows_past_32bit_element_offsets() -> None:
    """Real rows beyond 2**31 elements from the buffer start (64-bit offsets in the kernels)."""
    if torch.cuda.get_device_properties(0).total_memory < 100 * 2**30:
        pytest.skip("needs a GPU with 100 GiB (uses about 60 GiB)")
    heads, d = 16, 128
    _check_far_rows(gap=(2**31) // (heads * d) + 1000, heads=heads, d=d)


def _check_far_rows(gap: int, heads: int, d: int) -> None:
    """A 300-token sequence, ``gap`` padding rows, then a 257-token sequence and a short tail."""
    layout = make_layout("far", [300, 257], pad_q=[gap, 0], capacity_q=3)
    q, k, v, do = make_qkv(layout, heads, heads, d, d, torch.bfloat16, DEVICE, poison=None)
    kwargs = {**layout.kwargs(DEVICE), "causal": True}
    got = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    # The reference on the compact (unpadded) copy of the real rows.
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    compact = make_layout("compact", [300, 257])
    want = _fwd_bwd(
        reference.attention,
        [q[real_q].float(), k[real_kv].float(), v[real_kv].float()],
        do[real_q].float(),
        {**compact.kwargs(DEVICE), "causal": True},
    )
    picks = (real_q, None, real_q, real_kv, real_kv)
    for name, g, w, rows in zip(("out", "lse", "dq", "dk", "dv"), got, want, picks, strict=True):
        g = g[:, real_q] if rows is None else g[rows]
        scale = 1.0 if name in ("out", "lse") else max(1.0, float(w.abs().max()))
        assert_close(g.float(), w, name, atol=TOL * scale, rtol=TOL)
    pad_q = ~real_q
    assert bool((got[0][pad_q] == 0).all()) and bool((got[1][:, pad_q] == float("-inf")).all())
    assert bool((got[2][pad_q] == 0).all())


def test_attention_gpu_poisoned_padding_changes_nothing() -> None:
    q, k, v, do = make_qkv(CROSS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    kwargs = {**CROSS.kwargs(DEVICE), "causal": True, "deterministic": True}
    with poisoned_allocations():  # NaN in fresh memory as well as in the padding rows
        nan = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    _check_padding(CROSS, nan)
    sides = ((q, "q"), (k, "kv"), (v, "kv"))
    garbage = [poison_rows(t, CROSS.real_rows(s, DEVICE), 6e4) for t, s in sides]
    other = _fwd_bwd(thd.attention, garbage, do, kwargs)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), nan, other, strict=True):
        assert torch.equal(a, b), f"{name} depends on the contents of padding rows"
