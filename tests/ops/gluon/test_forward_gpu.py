"""The Gluon forward (``thd.ops.attention.gluon.forward``) on an H200 against the float64 reference.

Packed and padded-slot layouts with NaN in every padding and spare row of q, k, v; outputs allocated
NaN-filled, so a padding row the kernel forgets to write fails; real rows within the bf16/fp16
tolerances of the reference; padding rows of ``out`` exactly 0 and of ``lse`` exactly -inf. Causal
and not, GQA, head dims 64, 128 and 256 (and D != Dv), windows, softcap, sinks, positions, accumulate
mode, against the ``tl`` forward as well; CUDA-graph capture and replay on new ``cu_seqlens``.
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import (
    Layout,
    assert_close,
    assert_rows_equal,
    make_layout,
    make_qkv,
    poisoned_allocations,
)
from tests.ops.gluon._tl import reference_forward, tl_forward
from thd.ops.attention.params import AttentionOptions, ForwardCall, VarlenLayout

pytestmark = pytest.mark.gpu

gluon_forward = pytest.importorskip("thd.ops.attention.gluon.forward")

BF16, FP16 = torch.bfloat16, torch.float16
# (atol, rtol) of out against float64; lse atol (fp32 statistics)
OUT_TOL = {BF16: (2.5e-2, 2.5e-2), FP16: (5e-3, 5e-3)}
LSE_ATOL = 1e-3

LAYOUTS = {
    # lengths that end inside and on tile edges, a zero-length and a one-row document, spare rows
    "packed": make_layout("packed", [300, 1, 128, 0, 517, 64], capacity_q=37),
    "slots128": make_layout("slots128", [300, 1, 128, 77, 517], pad_q=[84, 127, 0, 51, 123], capacity_q=5),
    "cross": make_layout("cross", [130, 7, 260], [333, 200, 5], pad_q=[3, 0, 9], pad_kv=[0, 8, 1]),
}


def _skip_unless_sm90() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _varlen(layout: Layout) -> VarlenLayout:
    kw = layout.kwargs("cuda")
    return VarlenLayout(
        cu_seqlens_q=kw["cu_seqlens_q"],
        cu_seqlens_kv=kw["cu_seqlens_kv"],
        cu_seqlens_q_padded=kw["cu_seqlens_q_padded"],
        cu_seqlens_kv_padded=kw["cu_seqlens_kv_padded"],
        max_seqlen_q=layout.max_seqlen_q,
        max_seqlen_kv=layout.max_seqlen_kv,
    )


def _reference(q, k, v, varlen: VarlenLayout, options: AttentionOptions, sinks=None):  # type: ignore[no-untyped-def]
    return reference_forward(
        q.double(), k.double(), v.double(), varlen, options, None if sinks is None else sinks.double()
    )


def _check(layout: Layout, out, lse, ref_out, ref_lse, dtype) -> None:  # type: ignore[no-untyped-def]
    real = layout.real_rows("q", "cuda")
    atol, rtol = OUT_TOL[dtype]
    assert_close(out[real], ref_out[real].to(out.dtype), "out", atol=atol, rtol=rtol)
    assert_close(lse[:, real], ref_lse[:, real].float(), "lse", atol=LSE_ATOL, rtol=0.0)
    assert_rows_equal(out, ~real, 0.0, "out padding")
    assert_rows_equal(lse, ~real, float("-inf"), "lse padding", dim=1)


def _run(layout, heads_q, heads_kv, dim, dim_v, dtype, options, sinks=None, seed=0):  # type: ignore[no-untyped-def]
    _skip_unless_sm90()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, _ = make_qkv(layout, heads_q, heads_kv, dim, dim_v, dtype, "cuda", generator=gen)
    varlen = _varlen(layout)
    assert gluon_forward.supports_forward(ForwardCall(q, k, v, varlen, options, sinks))
    with poisoned_allocations():
        out, lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options, sinks))
    ref_out, ref_lse = _reference(q, k, v, varlen, options, sinks)
    _check(layout, out, lse, ref_out, ref_lse, dtype)
    return q, k, v, varlen, out, lse


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_matches_reference(name: str, causal: bool, dim: int, dtype: torch.dtype) -> None:
    options = AttentionOptions(dim**-0.5, causal=causal)
    _run(LAYOUTS[name], 4, 2, dim, dim, dtype, options)


@pytest.mark.parametrize(
    ("dim", "dim_v", "heads_q", "heads_kv"), [(128, 64, 4, 1), (64, 128, 6, 3), (128, 128, 8, 8)]
)
def test_forward_head_dims_and_groups(dim: int, dim_v: int, heads_q: int, heads_kv: int) -> None:
    _run(LAYOUTS["slots128"], heads_q, heads_kv, dim, dim_v, BF16, AttentionOptions(0.1, causal=True))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_head_dim_256(name: str, causal: bool, dtype: torch.dtype) -> None:
    """The head-dim-256 tile (32-row key tiles): every layout, causal and not, GQA."""
    _run(LAYOUTS[name], 4, 2, 256, 256, dtype, AttentionOptions(256**-0.5, causal=causal))


@pytest.mark.parametrize(("dim", "dim_v"), [(256, 128), (64, 256)])
def test_forward_head_dim_256_beside_another(dim: int, dim_v: int) -> None:
    _run(LAYOUTS["cross"], 6, 3, dim, dim_v, BF16, AttentionOptions(0.1, causal=False))


def test_forward_head_dim_256_variants_and_accumulate_match_tl() -> None:
    """Window, softcap and sinks at head dim 256 against the float64 reference, then the same call
    folded into a tl partial result (``accumulate``) against the tl forward doing the same."""
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")], device="cuda")
    options = AttentionOptions(256**-0.5, causal=True, window_size=(200, -1), softcap=5.0)
    q, k, v, varlen, _, _ = _run(LAYOUTS["slots128"], 4, 2, 256, 256, BF16, options, sinks)
    first = tl_forward(q, k, v, varlen, AttentionOptions(256**-0.5, causal=True))
    partial_tl = (first[0].float(), first[1].clone())
    partial_gl = (first[0].float(), first[1].clone())
    tl_forward(q, k, v, varlen, options, sinks, accumulate=partial_tl)
    gluon_forward.forward(ForwardCall(q, k, v, varlen, options, sinks, partial_gl))
    real = LAYOUTS["slots128"].real_rows("q", "cuda")
    assert_close(partial_gl[0][real], partial_tl[0][real], "accumulated out vs tl", atol=2e-2, rtol=2e-2)
    assert_close(partial_gl[1][:, real], partial_tl[1][:, real], "accumulated lse vs tl", atol=1e-3, rtol=0.0)
    assert torch.equal(partial_gl[0][~real], partial_tl[0][~real])


SHORT = {  # every sequence within half a 128-row tile: GQA row packing applies
    "short-packed": make_layout("short-packed", [40, 64, 1, 0, 33, 64], capacity_q=9),
    "short-slots": make_layout("short-slots", [40, 64, 1, 33], pad_q=[8, 0, 63, 31], capacity_q=3),
}


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(8, 2), (4, 2)])
@pytest.mark.parametrize("name", list(SHORT))
def test_gqa_row_packing_on_short_sequences(
    name: str, heads_q: int, heads_kv: int, causal: bool, dtype: torch.dtype
) -> None:
    layout = SHORT[name]
    call_heads = (heads_q, heads_kv)
    q, k, v, varlen, _, _ = _run(layout, *call_heads, 128, 128, dtype, AttentionOptions(0.1, causal=causal))
    assert (
        gluon_forward.packed_heads(
            ForwardCall(q, k, v, varlen, AttentionOptions(0.1)), gluon_forward.TILES[128]
        )
        == 2
    )


def test_gqa_row_packing_variants_and_accumulate_match_tl() -> None:
    """Window, sinks and a partial result to fold into (as ring steps pass them), packed, against
    the float64 reference and then the tl forward doing the same fold."""
    layout = SHORT["short-slots"]
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf"), 0.0, 1.0, -2.0, 0.25], device="cuda")
    options = AttentionOptions(0.1, causal=True, window_size=(20, -1))
    q, k, v, varlen, _, _ = _run(layout, 8, 2, 128, 128, BF16, options, sinks)
    first = tl_forward(q, k, v, varlen, AttentionOptions(0.1, causal=True))
    partial_tl = (first[0].float(), first[1].clone())
    partial_gl = (first[0].float(), first[1].clone())
    tl_forward(q, k, v, varlen, options, sinks, accumulate=partial_tl)
    gluon_forward.forward(ForwardCall(q, k, v, varlen, options, sinks, partial_gl))
    real = layout.real_rows("q", "cuda")
    assert_close(partial_gl[0][real], partial_tl[0][real], "accumulated out vs tl", atol=2e-2, rtol=2e-2)
    assert_close(partial_gl[1][:, real], partial_tl[1][:, real], "accumulated lse vs tl", atol=1e-3, rtol=0.0)
    assert torch.equal(partial_gl[0][~real], partial_tl[0][~real])


TWO_CONSUMERS = gluon_forward.GluonTile(128, 128, 4, 3)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_consumer_warpgroups_at_head_dim_64(
    name: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head-dim-128 structure (two 64-row consumer partitions) at 64, where the default tile
    has three (``TILES[64]``)."""
    assert gluon_forward.TILES[64].consumers == 3
    monkeypatch.setitem(gluon_forward.TILES, 64, TWO_CONSUMERS)
    _run(LAYOUTS[name], 4, 2, 64, 64, BF16, AttentionOptions(64**-0.5, causal=causal))


VARIANTS = {
    "window": AttentionOptions(128**-0.5, window_size=(100, 20)),
    "causal-window": AttentionOptions(128**-0.5, causal=True, window_size=(200, -1)),
    "softcap": AttentionOptions(128**-0.5, causal=True, softcap=5.0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_variants(variant: str) -> None:
    _run(LAYOUTS["slots128"], 4, 2, 128, 128, BF16, VARIANTS[variant])


def test_forward_sinks() -> None:
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")], device="cuda")
    _run(LAYOUTS["packed"], 4, 2, 64, 64, FP16, AttentionOptions(64**-0.5, causal=True), sinks)


def test_forward_matches_tl_forward() -> None:
    """Same inputs through the ``tl`` forward: both kernels agree on real rows and padding."""
    layout = LAYOUTS["slots128"]
    q, k, v, varlen, out, lse = _run(layout, 4, 2, 128, 128, BF16, AttentionOptions(128**-0.5, causal=True))
    tl_out, tl_lse = tl_forward(q, k, v, varlen, AttentionOptions(128**-0.5, causal=True))
    real = layout.real_rows("q", "cuda")
    assert_close(out[real], tl_out[real], "out vs tl", atol=1.6e-2, rtol=1.6e-2)
    assert_close(lse, tl_lse, "lse vs tl", atol=1e-4, rtol=0.0)
    assert torch.equal(out[~real], tl_out[~real])


def test_forward_accumulate_matches_tl() -> None:
    """``accumulate=(out, lse)`` folds a second key set into a partial result, as the ring does;
    rows outside the launch's real rows are left as they were."""
    _skip_unless_sm90()
    layout = LAYOUTS["slots128"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, _ = make_qkv(layout, 4, 2, 128, 128, BF16, "cuda", generator=gen)
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    varlen = _varlen(layout)
    options = AttentionOptions(128**-0.5, causal=True)
    first = tl_forward(q, k, v, varlen, options)
    partial_tl = (first[0].float(), first[1].clone())
    partial_gl = (first[0].float(), first[1].clone())
    sentinel = 7.0
    real = layout.real_rows("q", "cuda")
    for out, lse in (partial_tl, partial_gl):
        out[~real] = sentinel
        lse[:, ~real] = sentinel
    tl_forward(q, k2, v2, varlen, AttentionOptions(128**-0.5), accumulate=partial_tl)
    assert gluon_forward.supports_forward(ForwardCall(q, k2, v2, varlen, options, accumulate=partial_gl))
    gluon_forward.forward(ForwardCall(q, k2, v2, varlen, AttentionOptions(128**-0.5), accumulate=partial_gl))
    assert_close(partial_gl[0][real], partial_tl[0][real], "accumulated out", atol=2e-2, rtol=2e-2)
    assert_close(partial_gl[1][:, real], partial_tl[1][:, real], "accumulated lse", atol=1e-3, rtol=0.0)
    assert_rows_equal(partial_gl[0], ~real, sentinel, "untouched out rows")
    assert_rows_equal(partial_gl[1], ~real, sentinel, "untouched lse rows", dim=1)


def test_forward_positions() -> None:
    """Chunks of longer sequences placed by ``positions_*`` (the ring's steps)."""
    _skip_unless_sm90()
    layout = LAYOUTS["cross"]
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, _ = make_qkv(layout, 4, 4, 64, 64, BF16, "cuda", generator=gen)
    pos_q = torch.tensor([400, 10, 0], dtype=torch.int32, device="cuda")
    pos_kv = torch.tensor([0, 9, 100], dtype=torch.int32, device="cuda")
    base = _varlen(layout)
    varlen = VarlenLayout(**{**base.__dict__, "positions_q": pos_q, "positions_kv": pos_kv})
    options = AttentionOptions(0.125, causal=True, window_size=(300, -1))
    with poisoned_allocations():
        out, lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
    ref_out, ref_lse = _reference(q, k, v, varlen, options)
    _check(layout, out, lse, ref_out, ref_lse, BF16)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_forward_no_host_sync_and_cuda_graph_replay(dynamic: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured once, replayed (twice) after new document boundaries are copied into the same
    offsets: the replay equals an eager call on the new layout, bit for bit; no host sync while
    capturing; in both work orders (the dynamic one's ticket is reset in the graph too)."""
    _skip_unless_sm90()
    monkeypatch.setattr(gluon_forward, "DYNAMIC_ORDER", dynamic)
    gluon_forward.PLANS.clear()
    old = make_layout("old", [200, 56, 300], pad_q=[56, 8, 20], capacity_q=16)
    new = make_layout("new", [10, 246, 290], pad_q=[0, 10, 84], capacity_q=16)
    assert old.total_q == new.total_q
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, _ = make_qkv(old, 4, 2, 128, 128, BF16, "cuda", generator=gen, poison=None)
    options = AttentionOptions(128**-0.5, causal=True)
    varlen = VarlenLayout(
        cu_seqlens_q=old.cu("q", "cuda")[0],
        cu_seqlens_kv=old.cu("q", "cuda")[0].clone(),
        cu_seqlens_q_padded=old.cu("q", "cuda")[1],
        cu_seqlens_kv_padded=old.cu("q", "cuda")[1].clone(),
        max_seqlen_q=512,
        max_seqlen_kv=512,
    )
    gluon_forward.forward(ForwardCall(q, k, v, varlen, options))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out, lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cu, cup = new.cu("q", "cuda")
    for dst, src in zip(varlen.tensors()[:4], (cu, cu, cup, cup), strict=True):
        dst.copy_(src)
    graph.replay()
    graph.replay()
    eager_out, eager_lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
    gluon_forward.PLANS.clear()
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    ref_out, ref_lse = _reference(q, k, v, varlen, options)
    _check(new, out, lse, ref_out, ref_lse, BF16)


def test_supports_forward_refuses_what_it_does_not_cover() -> None:
    _skip_unless_sm90()
    layout = LAYOUTS["packed"]
    q, k, v, _ = make_qkv(layout, 2, 2, 128, 128, BF16, "cuda", poison=None)
    varlen = _varlen(layout)
    options = AttentionOptions(0.1)
    assert gluon_forward.supports_forward(ForwardCall(q, k, v, varlen, options))
    assert not gluon_forward.supports_forward(ForwardCall(q.float(), k.float(), v.float(), varlen, options))
    q96 = torch.zeros(q.shape[0], 2, 96, device="cuda", dtype=BF16)
    assert not gluon_forward.supports_forward(ForwardCall(q96, q96, q96, varlen, options))
    assert not gluon_forward.supports_forward(ForwardCall(q.cpu(), k.cpu(), v.cpu(), varlen, options))


def test_forward_without_max_seqlen_or_with_an_underestimate() -> None:
    """The work list comes from the offsets on the device: ``max_seqlen_*`` None or too small
    changes nothing, and no host sync happens."""
    _skip_unless_sm90()
    layout = LAYOUTS["packed"]
    q, k, v, _ = make_qkv(layout, 4, 2, 64, 64, BF16, "cuda")
    options = AttentionOptions(0.125, causal=True)
    base = _varlen(layout)
    for max_seqlen in (None, 3):
        varlen = VarlenLayout(**{**base.__dict__, "max_seqlen_q": max_seqlen, "max_seqlen_kv": max_seqlen})
        assert gluon_forward.supports_forward(ForwardCall(q, k, v, varlen, options))
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref_out, ref_lse = _reference(q, k, v, base, options)
        _check(layout, out, lse, ref_out, ref_lse, BF16)


@pytest.mark.parametrize("dim", [64, 128])
def test_wait_profile_counts_every_item_and_tile_and_keeps_the_output(
    dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``WAIT_PROFILE`` set the kernel gives the same output and counts, summed over programs,
    every work item once per consumer warpgroup and every key tile once per partition (the oracle:
    each document's causal query tiles and the key tiles up to each one's last row, times the heads)."""
    layout = LAYOUTS["packed"]
    options = AttentionOptions(dim**-0.5, causal=True)
    q, k, v, varlen, out, lse = _run(layout, 4, 2, dim, dim, BF16, options)
    tile = gluon_forward.tile_for(dim, dim)
    buffer = torch.zeros(tile.consumers + 1, 16, dtype=torch.int64, device="cuda")
    monkeypatch.setattr(gluon_forward, "WAIT_PROFILE", buffer)
    profiled_out, profiled_lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
    assert torch.equal(profiled_out, out) and torch.equal(profiled_lse, lse)
    bm, bn = tile.block_m, tile.block_n
    tiles = [[-(-min((m + 1) * bm, n) // bn) for m in range(-(-n // bm))] for n in layout.lens_q]
    items = 4 * sum(len(t) for t in tiles)
    key_tiles = 4 * sum(sum(t) for t in tiles)
    counts = buffer.cpu().tolist()
    for wg in range(tile.consumers):
        row = counts[wg]
        assert row[10] == items and row[9] == key_tiles, (wg, row)
        assert row[0] > 0 and all(0 <= x <= row[0] for x in row[1:9]), (wg, row)
    producer = counts[tile.consumers]
    assert producer[6] == items and producer[5] == key_tiles, producer


def test_offsets_written_in_place_get_a_new_work_list() -> None:
    """A call on offsets that were written in place since the previous call on the same tensors
    (the cached work list must not be reused): the output is the new layout's."""
    _skip_unless_sm90()
    old = LAYOUTS["packed"]
    new = make_layout("packed-reordered", [64, 517, 0, 128, 1, 300], capacity_q=37)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, _ = make_qkv(new, 4, 2, 128, 128, BF16, "cuda", generator=gen)
    varlen = _varlen(old)
    options = AttentionOptions(128**-0.5, causal=True)
    gluon_forward.forward(ForwardCall(q, k, v, varlen, options))  # caches the old layout's list
    moved = _varlen(new)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if getattr(varlen, name) is not None:
            getattr(varlen, name).copy_(getattr(moved, name))
    out, lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
    _check(new, out, lse, *_reference(q, k, v, moved, options), BF16)


@pytest.mark.parametrize("programs", [None, 7], ids=["all-sms", "7-programs"])
@pytest.mark.parametrize("order", ["static", "serpentine", "dynamic", "dynamic-sequence-major"])
@pytest.mark.parametrize(("section", "heads_q", "heads_kv"), [(1, 4, 2), (2, 6, 3), (3, 6, 2), (4, 12, 4)])
def test_work_orders_change_the_order_not_the_result(
    section: int, heads_q: int, heads_kv: int, order: str, programs: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Work lists in sections of fewer heads (``HEAD_SECTION``), taken in static rounds, serpentine
    rounds or dynamically from a ticket (also over the list in sequence-major order,
    ``SEQUENCE_MAJOR``), by every SM's program or by 7 (many rounds, a partial last one), cover
    every (query tile, head) once: the output matches the reference and, bit for bit,
    the plain order's (every head in one section, static rounds); calls again on the same
    (cached) work list give the same bits, so the ticket was left at zero."""
    _skip_unless_sm90()
    layout = LAYOUTS["packed"]
    options = AttentionOptions(128**-0.5, causal=True)
    monkeypatch.setattr(gluon_forward, "HEAD_SECTION", 0)  # the plain order: every G-th item
    monkeypatch.setattr(gluon_forward, "SERPENTINE", False)
    monkeypatch.setattr(gluon_forward, "DYNAMIC_ORDER", False)
    monkeypatch.setattr(gluon_forward, "SEQUENCE_MAJOR", False)
    gluon_forward.PLANS.clear()
    q, k, v, varlen, out, lse = _run(layout, heads_q, heads_kv, 128, 128, BF16, options)
    monkeypatch.setattr(gluon_forward, "HEAD_SECTION", section)
    monkeypatch.setattr(gluon_forward, "SERPENTINE", order == "serpentine")
    monkeypatch.setattr(gluon_forward, "DYNAMIC_ORDER", order.startswith("dynamic"))
    monkeypatch.setattr(gluon_forward, "SEQUENCE_MAJOR", order.endswith("sequence-major"))
    if programs is not None:
        monkeypatch.setattr(gluon_forward, "num_sms", lambda index: programs)
    gluon_forward.PLANS.clear()
    try:
        for _ in range(3):
            with poisoned_allocations():
                ordered_out, ordered_lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
            assert torch.equal(ordered_out, out) and torch.equal(ordered_lse, lse)
    finally:
        gluon_forward.PLANS.clear()


@pytest.mark.parametrize("dim", [64, 128])
def test_nan_in_a_real_key_propagates(dim: int) -> None:
    """NaN in one element of 16 consecutive real keys (every column position of a 16-column group,
    so every register slot of a thread's scores): exactly the queries that see such a key get NaN
    rows, as in the float64 reference; every other row keeps its value."""
    _skip_unless_sm90()
    layout = make_layout("nan-keys", [200, 90], capacity_q=3)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, _ = make_qkv(layout, 4, 2, dim, dim, BF16, "cuda", generator=gen)
    varlen = _varlen(layout)
    options = AttentionOptions(dim**-0.5, causal=True)
    for key in range(64, 80):  # sequence 0: queries key..199 see key (causal)
        k[key, key % 2, key % dim] = float("nan")
    out, lse = gluon_forward.forward(ForwardCall(q, k, v, varlen, options))
    ref_out, ref_lse = _reference(q, k, v, varlen, options)
    want_nan = ref_out.isnan()
    assert bool(want_nan.any()) and not bool(want_nan.all())
    assert torch.equal(out.isnan(), want_nan), "the NaN pattern differs from the reference"
    assert torch.equal(lse.isnan(), ref_lse.isnan())
    finite = ~want_nan
    atol, rtol = OUT_TOL[BF16]
    assert_close(out[finite], ref_out[finite].to(out.dtype), "out (finite part)", atol=atol, rtol=rtol)
