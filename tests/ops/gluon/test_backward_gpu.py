"""The Gluon sm_90 backward on the GPU against two oracles: autograd through the torch reference
(``thd.ops.attention.reference.attention`` in fp32 on the same rounded inputs) and the tl backward
(``thd.ops.attention.launch.backward``) on the same ``out`` / ``lse``.

Layouts: packed and padded slots with spare capacity, padding rows of q, k, v (and out, dO) NaN;
gradients must match on real rows and be exact zeros on padding rows. Both dQ paths run (fp32
from the dK/dV kernel, forced through ``ATOMIC_DQ``: a TMA reduce-add per tile with two partitions,
per-element atomics with one; its own kernel, the default and the
deterministic path, which must be bitwise reproducible), both consumer structures (two 4-warp
partitions, the default tiles; one 8-warp partition, ``ONE_CONSUMER_TILES``) and both ways of
running the dK/dV kernel (a program per key tile; persistent programs over a work list).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from tests._helpers import Layout, assert_rows_equal, make_layout, make_qkv, poison_rows

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.ops.gluon._tl import backward_call, tl_backward, tl_forward  # noqa: E402
from thd.ops.attention import reference  # noqa: E402
from thd.ops.attention.gluon import backward as gluon_backward  # noqa: E402
from thd.ops.attention.gluon.work_lists import planned_work_list  # noqa: E402
from thd.ops.attention.params import AttentionOptions, VarlenLayout  # noqa: E402

if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Gluon kernels are sm_90 only", allow_module_level=True)

DEVICE = "cuda"
GRADS = ("dq", "dk", "dv")

LAYOUTS = {
    "packed": make_layout("packed", [300, 1000, 77, 513]),
    "padded": make_layout("padded", [300, 1000, 77, 513], pad_q=[5, 0, 51, 128], capacity_q=70),
    "cross": make_layout("cross", [200, 64, 700], [900, 64, 129], pad_q=3, pad_kv=[0, 17, 64], capacity_q=9),
}


def _varlen(layout: Layout) -> VarlenLayout:
    cu_q, cup_q = layout.cu("q", DEVICE)
    cu_kv, cup_kv = layout.cu("kv", DEVICE)
    return VarlenLayout(
        cu_q,
        cu_kv,
        cup_q if layout.padded else None,
        cup_kv if layout.padded else None,
        layout.max_seqlen_q,
        layout.max_seqlen_kv,
    )


def _case(layout: Layout, heads: tuple[int, int], dim: int, dtype: torch.dtype, options: AttentionOptions):
    q, k, v, do = make_qkv(layout, heads[0], heads[1], dim, dim, dtype, DEVICE)
    varlen = _varlen(layout)
    out, lse = tl_forward(q, k, v, varlen, options)
    real_q = layout.real_rows("q", DEVICE)
    do = poison_rows(do, real_q)
    out = poison_rows(out, real_q)  # the backward reads neither on padding rows
    return q, k, v, do, out, lse, varlen


def _reference_grads(q, k, v, do, layout: Layout, options: AttentionOptions, sinks=None) -> dict[str, Tensor]:
    """fp32 autograd through the torch reference; NaN padding rows are never read by it."""
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.float().requires_grad_()
    kwargs = layout.kwargs(DEVICE)
    out = reference.attention(
        *leaves,
        **kwargs,
        causal=options.causal,
        softmax_scale=options.softmax_scale,
        window_size=options.window_size,
        softcap=options.softcap,
        sinks=sink_leaf,
    )
    real_q = layout.real_rows("q", DEVICE)[:, None, None]
    out.backward(torch.where(real_q, do.float(), 0.0))
    grads = dict(zip(GRADS, (t.grad for t in leaves), strict=True))
    if sink_leaf is not None:
        grads["dsinks"] = sink_leaf.grad
    return grads


def _rel_err(actual: Tensor, expected: Tensor, rows: Tensor) -> float:
    a, e = actual[rows].double(), expected[rows].double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def _check(layout: Layout, got, tl_grads, ref: dict[str, Tensor], limit: float = 2e-2) -> None:
    real = {"dq": layout.real_rows("q", DEVICE), "dk": layout.real_rows("kv", DEVICE)}
    real["dv"] = real["dk"]
    for name, g, t in zip(GRADS, got[:3], tl_grads[:3], strict=True):
        assert_rows_equal(g, ~real[name], 0.0, f"gluon {name} padding")
        assert bool(torch.isfinite(g[real[name]]).all()), f"gluon {name}: non-finite on real rows"
        err, tl_err = _rel_err(g, ref[name], real[name]), _rel_err(t, ref[name], real[name])
        # as close to the fp32 oracle as the tl kernels are (bf16 rounding of P and dS in both)
        assert err < limit and err <= 1.25 * tl_err + 1e-3, f"{name}: gluon {err:.2e}, tl {tl_err:.2e}"


def _both(do, q, k, v, out, lse, varlen, options, **kwargs):
    got = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options, **kwargs))
    tl_grads = tl_backward(do, q, k, v, out, lse, varlen, options, **kwargs)
    return got, tl_grads


DKDV_PROGRAMS = ["per-tile", "persistent", "dynamic"]


@pytest.fixture(autouse=True, params=DKDV_PROGRAMS)
def dkdv_programs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test runs with one dK/dV program per key tile and with the persistent programs over
    the device-built list of key tiles (``backward.PERSISTENT``), in static rounds and taking their
    items from the global ticket (``backward.DYNAMIC_ORDER``)."""
    monkeypatch.setattr(gluon_backward, "PERSISTENT", request.param != "per-tile")
    monkeypatch.setattr(gluon_backward, "DYNAMIC_ORDER", request.param == "dynamic")
    gluon_backward.PLANS.clear()
    yield request.param
    gluon_backward.PLANS.clear()


@pytest.fixture
def atomic_dq(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gluon_backward, "ATOMIC_DQ", True)


@pytest.fixture
def one_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gluon_backward, "TILES", dict(gluon_backward.ONE_CONSUMER_TILES))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize(
    ("layout_name", "causal", "dim", "heads"),
    [
        ("packed", True, 128, (4, 4)),
        ("padded", True, 64, (8, 2)),
        ("padded", False, 128, (6, 3)),
        ("cross", True, 128, (4, 1)),
        ("cross", False, 64, (4, 4)),
    ],
)
def test_gradients_match_reference_and_tl(
    layout_name, causal, dim, heads, deterministic, dtype, monkeypatch
) -> None:
    monkeypatch.setattr(gluon_backward, "ATOMIC_DQ", not deterministic)
    layout = LAYOUTS[layout_name]
    options = AttentionOptions(dim**-0.5, causal=causal, deterministic=deterministic)
    q, k, v, do, out, lse, varlen = _case(layout, heads, dim, dtype, options)
    assert gluon_backward.supports_backward(backward_call(do, q, k, v, out, lse, varlen, options))
    got, tl_grads = _both(do, q, k, v, out, lse, varlen, options)
    assert [g.dtype for g in got[:3]] == [dtype] * 3 and got[3] is None
    _check(layout, got, tl_grads, _reference_grads(q, k, v, do, layout, options))


@pytest.mark.parametrize("window", [(100, 0), (37, 200), (-1, 60)])
def test_window_and_sinks(window) -> None:
    layout = LAYOUTS["padded"]
    options = AttentionOptions(0.1, window_size=window)
    sinks = torch.randn(4, device=DEVICE)
    q, k, v, do = make_qkv(layout, 4, 2, 128, 128, torch.bfloat16, DEVICE)
    varlen = _varlen(layout)
    out, lse = tl_forward(q, k, v, varlen, options, sinks=sinks)
    do = poison_rows(do, layout.real_rows("q", DEVICE))
    got, tl_grads = _both(do, q, k, v, out, lse, varlen, options, sinks=sinks)
    ref = _reference_grads(q, k, v, do, layout, options, sinks)
    _check(layout, got, tl_grads, ref)
    torch.testing.assert_close(got[3].float(), ref["dsinks"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize(
    ("layout_name", "dim", "heads", "window", "sinks"),
    [
        ("padded", 64, (8, 2), (-1, 0), False),
        ("packed", 64, (4, 4), (-1, -1), True),
        ("cross", 128, (4, 1), (100, 0), False),
        ("padded", 128, (6, 3), (-1, 0), True),
    ],
)
def test_softcap(layout_name, dim, heads, window, sinks, deterministic, monkeypatch) -> None:
    """Scores ``softcap * tanh(s / softcap)`` (a cap of 5 bends most of them) with the tiles the
    call gets (64-query dK/dV tiles at head dim 64), against the fp32 reference and tl."""
    monkeypatch.setattr(gluon_backward, "ATOMIC_DQ", not deterministic)
    layout = LAYOUTS[layout_name]
    options = AttentionOptions(dim**-0.5, window_size=window, softcap=5.0, deterministic=deterministic)
    sink_values = torch.randn(heads[0], device=DEVICE) if sinks else None
    q, k, v, do = make_qkv(layout, heads[0], heads[1], dim, dim, torch.bfloat16, DEVICE)
    varlen = _varlen(layout)
    out, lse = tl_forward(q, k, v, varlen, options, sinks=sink_values)
    real_q = layout.real_rows("q", DEVICE)
    do, out = poison_rows(do, real_q), poison_rows(out, real_q)
    assert gluon_backward.supports_backward(backward_call(do, q, k, v, out, lse, varlen, options))
    got, tl_grads = _both(do, q, k, v, out, lse, varlen, options, sinks=sink_values)
    ref = _reference_grads(q, k, v, do, layout, options, sink_values)
    _check(layout, got, tl_grads, ref)
    if sinks:
        torch.testing.assert_close(got[3].float(), ref["dsinks"], atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("atomic_dq")
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dq_rows", ["contiguous", "strided"])
def test_accumulate_adds_on_real_rows_only(dq_rows, softcap) -> None:
    """Also into a dq buffer whose heads are not adjacent in a row: no TMA reduce-add there, the
    per-element atomics instead; with softcap too (the ring's steps accumulate)."""
    layout = LAYOUTS["padded"]
    options = AttentionOptions(128**-0.5, causal=True, softcap=softcap)
    q, k, v, do, out, lse, varlen = _case(layout, (4, 2), 128, torch.bfloat16, options)
    start = [torch.randn(t.shape, device=DEVICE) for t in (q, k, v)]
    for deterministic in (False, True):
        opts = AttentionOptions(
            options.softmax_scale, causal=True, softcap=softcap, deterministic=deterministic
        )
        buffers = tuple(s.clone() for s in start)
        if dq_rows == "strided":
            wide = torch.full((q.shape[0], q.shape[1], 2 * q.shape[2]), float("nan"), device=DEVICE)
            wide[..., : q.shape[2]] = start[0]
            buffers = (wide[..., : q.shape[2]], *buffers[1:])
        got = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, opts, accumulate=buffers))
        assert all(g is b for g, b in zip(got[:3], buffers, strict=True))
        fresh = tl_backward(do, q, k, v, out, lse, varlen, opts)
        for name, g, s, f, side in zip(GRADS, got[:3], start, fresh[:3], "qkk", strict=True):
            real = layout.real_rows("q" if side == "q" else "kv", DEVICE)
            assert torch.equal(g[~real], s[~real]), f"{name}: a padding row changed"
            torch.testing.assert_close(g[real] - s[real], f[real].float(), atol=3e-2, rtol=3e-2)


def _run_twice(fn: Callable[[], tuple]) -> tuple[tuple, tuple]:
    return fn(), fn()


def test_deterministic_backward_is_bitwise_reproducible() -> None:
    layout = LAYOUTS["padded"]
    options = AttentionOptions(64**-0.5, causal=True, deterministic=True)
    q, k, v, do, out, lse, varlen = _case(layout, (8, 2), 64, torch.bfloat16, options)
    first, second = _run_twice(
        lambda: gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))
    )
    for name, a, b in zip(GRADS, first[:3], second[:3], strict=True):
        assert torch.equal(a, b), name


def test_use_deterministic_algorithms_selects_the_split_dq() -> None:
    layout = LAYOUTS["packed"]
    options = AttentionOptions(128**-0.5, causal=True)
    q, k, v, do, out, lse, varlen = _case(layout, (4, 4), 128, torch.bfloat16, options)
    explicit = gluon_backward.backward(
        backward_call(
            do, q, k, v, out, lse, varlen, AttentionOptions(128**-0.5, causal=True, deterministic=True)
        )
    )
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        implied = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))
    finally:
        torch.use_deterministic_algorithms(previous)
    for name, a, b in zip(GRADS, explicit[:3], implied[:3], strict=True):
        assert torch.equal(a, b), name


def test_nan_in_a_real_row_propagates() -> None:
    layout = LAYOUTS["padded"]
    options = AttentionOptions(128**-0.5, causal=True)
    q, k, v, do, out, lse, varlen = _case(layout, (4, 4), 128, torch.bfloat16, options)
    k = k.clone()
    k[305, 1, 5] = float("nan")  # sequence 1's first real key row (slot 0 is 305 rows)
    dq, dk, _, _ = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))
    assert bool(dq[305:1305, 1].isnan().all(dim=-1).any()) and bool(dk[305, 1].isnan().any())
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    assert_rows_equal(dq, ~real_q, 0.0, "dq padding")
    assert_rows_equal(dk, ~real_kv, 0.0, "dk padding")
    assert not bool(dq[:300].isnan().any()), "NaN leaked into another sequence"
    assert not bool(dk[:300].isnan().any()), "NaN leaked into another sequence"


@pytest.mark.usefixtures("atomic_dq")
def test_no_host_sync(no_host_reads) -> None:
    layout = LAYOUTS["padded"]
    options = AttentionOptions(64**-0.5, causal=True)
    q, k, v, do, out, lse, varlen = _case(layout, (4, 2), 64, torch.bfloat16, options)
    for deterministic in (False, True):
        opts = AttentionOptions(options.softmax_scale, causal=True, deterministic=deterministic)
        gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, opts))


@pytest.mark.usefixtures("one_consumer")
@pytest.mark.parametrize("atomic", [False, True], ids=["split-dq", "atomic-dq"])
@pytest.mark.parametrize(
    ("layout_name", "causal", "window", "dim", "heads"),
    [
        ("padded", True, (-1, -1), 64, (8, 2)),
        ("padded", True, (-1, -1), 128, (4, 4)),
        ("cross", False, (-1, -1), 128, (4, 1)),
        ("padded", False, (37, 200), 64, (4, 2)),
    ],
)
def test_one_consumer_partition(layout_name, causal, window, dim, heads, atomic, monkeypatch) -> None:
    monkeypatch.setattr(gluon_backward, "ATOMIC_DQ", atomic)
    layout = LAYOUTS[layout_name]
    options = AttentionOptions(dim**-0.5, causal=causal, window_size=window)
    q, k, v, do, out, lse, varlen = _case(layout, heads, dim, torch.bfloat16, options)
    got, tl_grads = _both(do, q, k, v, out, lse, varlen, options)
    _check(layout, got, tl_grads, _reference_grads(q, k, v, do, layout, options))
    again = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))
    for name, a, b in zip(GRADS, got[:3], again[:3], strict=True):
        assert atomic or torch.equal(a, b), f"{name} not reproducible"


@pytest.mark.usefixtures("atomic_dq")
@pytest.mark.parametrize(
    ("layout_name", "causal", "window", "heads"),
    [
        ("packed", True, (-1, -1), (4, 4)),
        ("padded", True, (-1, -1), (8, 2)),
        ("cross", False, (-1, -1), (4, 1)),
        ("padded", False, (37, 200), (4, 2)),
    ],
)
@pytest.mark.parametrize("dq_rows", [True, False], ids=["dq-by-rows", "dq-by-columns"])
def test_dq_split_by_query_rows(layout_name, causal, window, heads, dq_rows, monkeypatch) -> None:
    """The head-dim-64 two-partition tile with ``dq_rows`` (each partition adds dQ of its half of the
    query rows by TMA reduce-add, FA3's split; the default) and without (each adds every row over half
    the columns): against the fp32 reference and tl, padding rows zero."""
    tiles = dict(gluon_backward.TILES)
    tiles[("dkdv", 64)] = replace(gluon_backward.TWO_CONSUMER_TILES[("dkdv", 64)], dq_rows=dq_rows)
    monkeypatch.setattr(gluon_backward, "TILES", tiles)
    layout = LAYOUTS[layout_name]
    options = AttentionOptions(64**-0.5, causal=causal, window_size=window)
    q, k, v, do, out, lse, varlen = _case(layout, heads, 64, torch.bfloat16, options)
    got, tl_grads = _both(do, q, k, v, out, lse, varlen, options)
    _check(layout, got, tl_grads, _reference_grads(q, k, v, do, layout, options))


@pytest.mark.usefixtures("atomic_dq")
def test_cuda_graph_replay_on_new_offsets() -> None:
    """Captured once on one layout (no host sync while capturing), replayed after another layout's
    document boundaries, ``out`` and ``lse`` are copied into the captured tensors: dK and dV equal an
    eager backward on the new layout bit for bit, dQ (fp32 adds in any order) to rounding, and all
    match the reference. The persistent programs' work list is rebuilt inside the graph."""
    old = make_layout("old", [200, 56, 300], pad_q=[56, 8, 20], capacity_q=16)
    new = make_layout("new", [10, 246, 290], pad_q=[0, 10, 84], capacity_q=16)
    assert old.total_q == new.total_q
    options = AttentionOptions(64**-0.5, causal=True)
    q, k, v, do, new_out, new_lse, new_varlen = _case(new, (4, 2), 64, torch.bfloat16, options)
    varlen, out, lse = _varlen(old), new_out.clone(), new_lse.clone()  # captured on the old offsets
    gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))  # compiled outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            captured = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for dst, src in zip(varlen.tensors()[:4], new_varlen.tensors()[:4], strict=True):
        dst.copy_(src)
    graph.replay()
    graph.replay()
    eager = gluon_backward.backward(backward_call(do, q, k, v, new_out, new_lse, new_varlen, options))
    assert torch.equal(captured[1], eager[1]) and torch.equal(captured[2], eager[2])
    torch.testing.assert_close(captured[0], eager[0], atol=1e-2, rtol=1e-2)
    tl_grads = tl_backward(do, q, k, v, new_out, new_lse, new_varlen, options)
    _check(new, captured, tl_grads, _reference_grads(q, k, v, do, new, options))


# Many short documents (one empty), slots padded: hundreds of (document, key tile, kv head) items.
_MANY_LENGTHS = [(37 * i) % 300 + (0 if i == 5 else 1) for i in range(40)]
LAYOUTS["many"] = make_layout("many", _MANY_LENGTHS, pad_q=[i % 3 * 7 for i in range(40)], capacity_q=33)


@pytest.mark.parametrize("dkdv_programs", ["persistent", "dynamic"], indirect=True)
@pytest.mark.parametrize("programs", [None, 3], ids=["one-per-sm", "three"])
@pytest.mark.parametrize(
    ("dim", "heads", "atomic"), [(64, (8, 2), True), (128, (4, 4), True), (64, (4, 4), False)]
)
def test_many_items_per_persistent_program(programs, dim, heads, atomic, monkeypatch) -> None:
    """Persistent programs run many items each (sequences and heads change between them; with
    three programs, dozens per program): gradients as the reference's and tl's, padding zeros."""
    if programs is not None:
        monkeypatch.setattr(gluon_backward, "device_sms", lambda t: programs)
    monkeypatch.setattr(gluon_backward, "ATOMIC_DQ", atomic)
    layout = LAYOUTS["many"]
    options = AttentionOptions(dim**-0.5, causal=True)
    q, k, v, do, out, lse, varlen = _case(layout, heads, dim, torch.bfloat16, options)
    got, tl_grads = _both(do, q, k, v, out, lse, varlen, options)
    _check(layout, got, tl_grads, _reference_grads(q, k, v, do, layout, options))
    (plan,) = gluon_backward.PLANS.values()
    sms = programs or torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.work_list is not None
    assert plan.dkdv.grid == (min(sms, plan.capacity * heads[1]),)


def _supported(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, options: AttentionOptions) -> bool:
    """``supports_backward`` of a call on these inputs (it reads only their metadata)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return gluon_backward.supports_backward(backward_call(q, q, k, v, out, lse, layout, options))


def test_supports_backward_turns_down_what_it_does_not_cover() -> None:
    layout = _varlen(LAYOUTS["packed"])
    plain = AttentionOptions(0.1, causal=True)
    q = torch.randn(64, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    assert _supported(q, q, q, layout, plain)
    assert _supported(q, q, q, layout, AttentionOptions(0.1, softcap=30.0))
    assert not _supported(q.float(), q.float(), q.float(), layout, plain)
    q96 = torch.randn(64, 4, 96, device=DEVICE, dtype=torch.bfloat16)
    assert not _supported(q96, q96, q96, layout, plain)
    v64 = torch.randn(64, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    assert not _supported(q, q, v64, layout, plain)  # D != Dv stays on tl
    assert not _supported(q.cpu(), q.cpu(), q.cpu(), layout, plain)


@pytest.mark.parametrize("dkdv_programs", ["dynamic"], indirect=True)
def test_dynamic_programs_leave_the_ticket_at_zero_for_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two backwards on the same offset tensors share one work list (``work_lists``' cache): the
    first launch's last program zeroes the ticket and done count, so the second takes every item
    again (dK and dV bit for bit: one program computes each key tile, whichever it is)."""
    lists = []

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        lists.append(planned_work_list(*args, **kwargs))
        return lists[-1]

    monkeypatch.setattr(gluon_backward, "planned_work_list", recorded)
    layout = LAYOUTS["many"]
    options = AttentionOptions(64**-0.5, causal=True)
    q, k, v, do, out, lse, varlen = _case(layout, (8, 2), 64, torch.bfloat16, options)
    first = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))
    second = gluon_backward.backward(backward_call(do, q, k, v, out, lse, varlen, options))
    torch.cuda.synchronize()
    assert len(lists) == 2 and all(a is b for a, b in zip(*lists, strict=True))  # one list, reused
    assert lists[0][2][1:3].tolist() == [0, 0]
    for name, a, b in zip(GRADS[1:], first[1:3], second[1:3], strict=True):
        assert torch.equal(a, b), name
    tl_grads = tl_backward(do, q, k, v, out, lse, varlen, options)
    _check(layout, second, tl_grads, _reference_grads(q, k, v, do, layout, options))
