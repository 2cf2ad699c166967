"""Window, softcap and sinks of ``thd.attention`` under CUDA graphs, ``torch.compile`` and the
sync checker (``make test-gpu``; skipped on CPU).

Each variant (a causal sliding window ``window_size=(W, 0)``, a softcap, sinks, and all three
together) is run through the places where capture safety and tracing matter:

- CUDA-graph capture of forward + backward, replayed with new ``cu_seqlens`` values (same
  shapes), new inputs and new sink values; after every replay the static outputs equal eager
  thd bitwise (deterministic backward) and match the float64 reference, ``dsinks`` included;
- ``torch.compile(fullgraph=True)`` (inductor) of a function calling ``thd.attention``: forward
  and backward equal eager thd bitwise and match the float64 reference;
- no host synchronisation when ``max_seqlen_*`` are given (``torch.cuda.set_sync_debug_mode``).

The oracle is :func:`thd.ops.attention.reference.attention` in float64 on the same (rounded)
inputs, differentiated by autograd. Padding rows of q, k, v hold NaN; padding rows of out, dq,
dk, dv must be exact zeros and lse ``-inf`` there. Each check is a ``_*_case`` function taking
its device-independent parameters, so that it can be run on tiny shapes elsewhere.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

import thd
from tests._helpers import (
    REFERENCE_NAMES,
    Layout,
    assert_close,
    assert_rows_equal,
    make_layout,
    make_qkv,
    reference64,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16
COMPILE_BACKEND = "inductor"
NAMES = REFERENCE_NAMES
CU_NAMES = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")

# Bounds against the float64 reference for bf16 inputs (as in test_attention_gpu.py): elementwise
# for out and lse on real rows, ``||a - b|| / ||b||`` for everything, and row by row
# ``||a_r - b_r|| <= ROW_FACTOR * rel * (||b_r|| + rms_r ||b_r||)``.
OUT_ATOL = OUT_RTOL = 2.5e-2
LSE_ATOL = 1e-3
REL_OUT, REL_GRAD = 1e-2, 2e-2
ROW_FACTOR = 8.0


@dataclass(frozen=True)
class Variant:
    """``thd.attention`` keywords of one variant, and whether it gets sinks."""

    name: str
    options: dict[str, Any] = field(hash=False)
    sinks: bool = False


WINDOW = 200  # crosses tile boundaries and is shorter than most sequences below
SOFTCAP = 5.0  # small enough that the tanh bends the scores of N(0, 1) inputs
VARIANTS = [
    Variant("window", {"causal": True, "window_size": (WINDOW, 0)}),
    Variant("softcap", {"causal": True, "softcap": SOFTCAP}),
    Variant("sinks", {"causal": True}, sinks=True),
    Variant("all", {"causal": True, "window_size": (WINDOW, 0), "softcap": SOFTCAP}, sinks=True),
]
ALL = VARIANTS[-1]
HEADS = (8, 2)  # GQA
DIM = 128


def _variant_params() -> list[Any]:
    return [pytest.param(v, id=v.name) for v in VARIANTS]


# --- running thd and the reference --------------------------------------------------------------

Attend = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], tuple[Tensor, Tensor]]


def _attend(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Attend:
    """``(q, k, v, sinks) -> (out, lse)`` of ``fn`` (thd or the reference) with fixed keywords."""

    def call(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
        return fn(q, k, v, **kwargs, sinks=sinks, return_lse=True)  # type: ignore[no-any-return]

    return call


def _sinks(variant: Variant, heads: int, gen: torch.Generator) -> Tensor | None:
    """fp32 sink logits ``[heads]`` around 2 (spread 2): large enough to take a visible share of
    the softmax over a window of ~200 keys, small enough to leave it to the keys in long rows."""
    if not variant.sinks:
        return None
    return torch.randn(heads, generator=gen, device=gen.device).to(DEVICE) * 2.0 + 2.0


def _fwd_bwd(fn: Attend, inputs: list[Tensor], do: Tensor, sinks: Tensor | None) -> dict[str, Tensor | None]:
    """``out, lse, dq, dk, dv, dsinks`` of ``fn`` on fresh leaves made from the inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    out, lse = fn(*leaves, sink_leaf)
    out.backward(do)
    grads = [t.grad for t in leaves] + [None if sink_leaf is None else sink_leaf.grad]
    assert all(g is not None for g in grads[:3])
    return dict(zip(NAMES, [out.detach(), lse.detach(), *grads], strict=True))


# --- comparisons ------------------------------------------------------------------------------


def _assert_rel(name: str, got: Tensor, want: Tensor, bound: float) -> None:
    """``||a - b|| / ||b||`` over all rows, and each row against ``||b_r|| + rms_r ||b_r||``."""
    a = got.detach().double().reshape(-1, got.shape[-1] if got.dim() else 1)
    b = want.detach().double().reshape(a.shape)
    diff_norm, ref_norm = float((a - b).norm()), float(b.norm())
    if ref_norm == 0.0:
        rel = worst = 0.0 if diff_norm == 0.0 else math.inf
    else:
        rows = b.norm(dim=-1)
        rel = diff_norm / ref_norm
        worst = float(((a - b).norm(dim=-1) / (rows + rows.square().mean().sqrt())).max())
    if not (rel <= bound and worst <= ROW_FACTOR * bound):
        raise AssertionError(
            f"{name}: ||a-b||/||b|| = {rel:.3e} (bound {bound:.1e}), worst row {worst:.3e} "
            f"(bound {ROW_FACTOR * bound:.1e}); non-finite in result: {int((~torch.isfinite(got)).sum())}"
        )


def _compare(
    layout: Layout, got: dict[str, Tensor | None], want: dict[str, Tensor | None], what: str
) -> None:
    """thd's results against the float64 reference's, on real rows (``dsinks`` over heads)."""
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    out, lse, w_out, w_lse = got["out"], got["lse"], want["out"], want["lse"]
    assert out is not None and lse is not None and w_out is not None and w_lse is not None
    assert out.dtype == BF16 and lse.dtype == torch.float32, f"{what}: dtypes {out.dtype}, {lse.dtype}"
    assert_close(out[real_q].float(), w_out[real_q], f"{what}: out", atol=OUT_ATOL, rtol=OUT_RTOL)
    assert_close(lse[:, real_q], w_lse[:, real_q].float(), f"{what}: lse", atol=LSE_ATOL, rtol=0.0)
    _assert_rel(f"{what}: out", out[real_q], w_out[real_q], REL_OUT)
    finite = torch.isfinite(w_lse[:, real_q])
    _assert_rel(f"{what}: lse", lse[:, real_q][finite], w_lse[:, real_q][finite], REL_OUT)
    for name, rows in (("dq", real_q), ("dk", real_kv), ("dv", real_kv)):
        g, w = got[name], want[name]
        assert g is not None and w is not None
        _assert_rel(f"{what}: {name}", g[rows], w[rows], REL_GRAD)
    if want["dsinks"] is None:
        assert got["dsinks"] is None, f"{what}: dsinks without sinks"
    else:
        dsinks = got["dsinks"]
        assert dsinks is not None, f"{what}: no gradient for sinks"
        assert dsinks.shape == want["dsinks"].shape and dsinks.dtype == torch.float32
        _assert_rel(f"{what}: dsinks", dsinks, want["dsinks"], REL_GRAD)


def _check_padding(layout: Layout, got: dict[str, Tensor | None], what: str) -> None:
    """Exact zeros on padding rows of out/dq/dk/dv, ``-inf`` in lse."""
    pad_q, pad_kv = ~layout.real_rows("q", DEVICE), ~layout.real_rows("kv", DEVICE)
    for name, pad, dim, value in (
        ("out", pad_q, 0, 0.0),
        ("lse", pad_q, 1, float("-inf")),
        ("dq", pad_q, 0, 0.0),
        ("dk", pad_kv, 0, 0.0),
        ("dv", pad_kv, 0, 0.0),
    ):
        x = got[name]
        assert x is not None
        assert_rows_equal(x, pad, value, f"{what}: {name}", dim=dim)


def _assert_equal(got: dict[str, Tensor | None], want: dict[str, Tensor | None], what: str) -> None:
    for name in NAMES:
        a, b = got[name], want[name]
        if a is None or b is None:
            assert a is None and b is None, f"{what}: {name} is None on one side only"
            continue
        assert torch.equal(a, b), f"{what}: {name} differs (max abs diff {float((a - b).abs().max()):.3e})"


def _synchronize() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


# --- layouts ----------------------------------------------------------------------------------


def _random_layout(
    name: str, seed: int, count: int, lo: int, hi: int, *, multiple: int, capacity: int
) -> Layout:
    """``count`` random lengths in ``[lo, hi]``, each slot padded up to a multiple of ``multiple``."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(count)]
    return make_layout(name, lens, pad_q=[-n % multiple for n in lens], capacity_q=capacity)


DOCS = _random_layout("docs", 0, 8, 1, 1024, multiple=64, capacity=77)

# Same number of sequences (cu shapes) and buffer size, different boundaries: slot padding, none,
# zero-length and one-token sequences, sequences shorter and much longer than the window,
# reserved capacity of different sizes (as in test_attention_gpu.py).
GRAPH_ROWS = 2048
GRAPH_LAYOUTS = [
    make_layout("g0", [300, 5, 700, 1, 0, 420], pad_q=[4, 59, 0, 3, 8, 1], capacity_q=547),
    make_layout("g1", [1000, 0, 0, 1, 640, 333], pad_q=0, capacity_q=74, padded=True),
    make_layout("g2", [1, 1, 1, 2045, 0, 0], pad_q=0, padded=True),
    make_layout("g3", [64, 128, 256, 512, 33, 7], pad_q=[0, 64, 0, 1, 31, 9], capacity_q=943),
]


# --- CUDA graphs ------------------------------------------------------------------------------

Capture = Callable[
    [Callable[[], tuple[Tensor, Tensor]], list[Tensor]], tuple[Callable[[], None], tuple[Tensor, Tensor]]
]


def _capture_cuda_graph(
    step: Callable[[], tuple[Tensor, Tensor]], leaves: list[Tensor]
) -> tuple[Callable[[], None], tuple[Tensor, Tensor]]:
    """Warm ``step`` up on a side stream (compiles, allocator pools), then capture it once.

    Returns the graph's replay and the static outputs; the static gradients are the leaves' ``grad``.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
            for t in leaves:
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph.replay, outputs


def _graph_case(
    variant: Variant,
    layouts: list[Layout],
    captured: int,
    heads: tuple[int, int],
    dim: int,
    deterministic: bool,
    capture: Capture = _capture_cuda_graph,
) -> None:
    """Capture forward+backward on ``layouts[captured]``, replay on every layout (that one last).

    After each replay: bitwise equal to eager thd with the same bounds (deterministic backward
    only), close to the float64 reference (``dsinks`` included), exact zeros on padding rows.
    """
    rows_q, rows_kv = layouts[0].total_q, layouts[0].total_kv
    assert all(lay.total_q == rows_q and lay.total_kv == rows_kv for lay in layouts)
    assert all(lay.padded for lay in layouts)  # the padded cu tensors exist to be overwritten
    hq, hkv = heads
    gen = torch.Generator(device="cpu").manual_seed(1)
    first = layouts[captured]
    static = first.kwargs(DEVICE, max_seqlen=False)
    bounds = {"max_seqlen_q": rows_q, "max_seqlen_kv": rows_kv}  # any replay's lengths fit
    options = {**variant.options, "deterministic": deterministic}
    call_kwargs = {**static, **bounds, **options}  # the cu tensors are static's: replays see new values
    q, k, v, do = (
        t.detach().clone() for t in make_qkv(first, hq, hkv, dim, dim, BF16, DEVICE, generator=gen)
    )
    sinks = _sinks(variant, hq, gen)
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([] if sinks is None else [sinks.requires_grad_()])

    def step() -> tuple[Tensor, Tensor]:
        out, lse = thd.attention(q, k, v, **call_kwargs, sinks=sinks, return_lse=True)
        out.backward(do)
        return out, lse

    replay, (static_out, static_lse) = capture(step, leaves)
    static_grads = [t.grad for t in leaves] + ([None] if sinks is None else [])

    for layout in layouts[captured + 1 :] + layouts[: captured + 1]:
        new_q, new_k, new_v, new_do = make_qkv(layout, hq, hkv, dim, dim, BF16, DEVICE, generator=gen)
        new_sinks = _sinks(variant, hq, gen)
        new_cu = layout.kwargs(DEVICE, max_seqlen=False)
        with torch.no_grad():
            for dst, src in zip((q, k, v, do), (new_q, new_k, new_v, new_do), strict=True):
                dst.copy_(src)
            if sinks is not None and new_sinks is not None:
                sinks.copy_(new_sinks)
            for name in CU_NAMES:
                static[name].copy_(new_cu[name])
        replay()
        _synchronize()
        what = f"{variant.name} captured on {first.name}, replayed on {layout.name}"
        replayed = dict(zip(NAMES, [static_out.detach(), static_lse, *static_grads], strict=True))
        new_kwargs = {**new_cu, **bounds, **options}
        if deterministic:
            eager = _fwd_bwd(_attend(thd.attention, new_kwargs), [new_q, new_k, new_v], new_do, new_sinks)
            _assert_equal(replayed, eager, f"{what} (vs eager)")
        want = reference64(layout, new_q, new_k, new_v, new_do, new_kwargs, new_sinks)
        _compare(layout, replayed, want, what)
        _check_padding(layout, replayed, what)


GRAPH_CASES = [pytest.param(v, 0, True, id=f"{v.name}-capture-slot-padded") for v in VARIANTS] + [
    pytest.param(ALL, 2, True, id="all-capture-unpadded"),  # cup == cu by value at capture
    pytest.param(ALL, 0, False, id="all-capture-slot-padded-default-backward"),
]


@pytest.mark.parametrize(("variant", "captured", "deterministic"), GRAPH_CASES)
def test_variants_cuda_graph_replay_with_new_cu_seqlens(
    variant: Variant, captured: int, deterministic: bool
) -> None:
    _graph_case(variant, GRAPH_LAYOUTS, captured, HEADS, DIM, deterministic)


# --- torch.compile ----------------------------------------------------------------------------


def _compile_case(variant: Variant, layout: Layout, heads: tuple[int, int], dim: int, backend: str) -> None:
    """``torch.compile(fullgraph=True)`` of a function calling ``thd.attention``: forward and
    backward equal eager thd bitwise and match the float64 reference."""
    hq, hkv = heads
    gen = torch.Generator(device="cpu").manual_seed(2)
    q, k, v, do = make_qkv(layout, hq, hkv, dim, dim, BF16, DEVICE, generator=gen)
    sinks = _sinks(variant, hq, gen)
    kwargs = {**layout.kwargs(DEVICE), **variant.options, "deterministic": True}

    def attend(q_: Tensor, k_: Tensor, v_: Tensor, sinks_: Tensor | None, **kw: Any) -> Any:
        return thd.attention(q_, k_, v_, **kw, sinks=sinks_, return_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend=backend)
    try:
        eager = _fwd_bwd(lambda *a: attend(*a, **kwargs), [q, k, v], do, sinks)
        got = _fwd_bwd(lambda *a: compiled(*a, **kwargs), [q, k, v], do, sinks)
    finally:
        torch._dynamo.reset()
    what = f"{variant.name} compiled ({backend})"
    _assert_equal(got, eager, f"{what} vs eager")
    want = reference64(layout, q, k, v, do, kwargs, sinks)
    _compare(layout, got, want, what)
    _check_padding(layout, got, what)


@pytest.mark.parametrize("variant", _variant_params())
def test_variants_torch_compile_fullgraph(variant: Variant) -> None:
    _compile_case(variant, DOCS, HEADS, DIM, COMPILE_BACKEND)


# --- no host synchronisation ------------------------------------------------------------------


@contextmanager
def _sync_is_an_error() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _no_sync_case(
    variant: Variant,
    layout: Layout,
    heads: tuple[int, int],
    dim: int,
    deterministic: bool,
    guard: Callable[[], Any] = _sync_is_an_error,
) -> None:
    """Forward + backward with ``max_seqlen_*`` given synchronise nothing (after a warm-up call,
    which compiles); the result is still right (bitwise the warm-up's with the deterministic
    backward, close to the reference otherwise)."""
    hq, hkv = heads
    gen = torch.Generator(device="cpu").manual_seed(3)
    q, k, v, do = make_qkv(layout, hq, hkv, dim, dim, BF16, DEVICE, generator=gen)
    sinks = _sinks(variant, hq, gen)
    kwargs = {**layout.kwargs(DEVICE), **variant.options, "deterministic": deterministic}
    warm = _fwd_bwd(_attend(thd.attention, kwargs), [q, k, v], do, sinks)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    _synchronize()
    with guard():
        out, lse = thd.attention(*leaves, **kwargs, sinks=sink_leaf, return_lse=True)
        out.backward(do)
    _synchronize()
    grads = [t.grad for t in leaves] + [None if sink_leaf is None else sink_leaf.grad]
    got = dict(zip(NAMES, [out.detach(), lse, *grads], strict=True))
    what = f"{variant.name} under the sync checker"
    if deterministic:
        _assert_equal(got, warm, what)
    else:
        _compare(layout, got, reference64(layout, q, k, v, do, kwargs, sinks), what)
    _check_padding(layout, got, what)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default-backward", "deterministic"])
@pytest.mark.parametrize("variant", _variant_params())
def test_variants_no_host_sync_with_max_seqlen(variant: Variant, deterministic: bool) -> None:
    _no_sync_case(variant, DOCS, HEADS, DIM, deterministic)
