"""Gluon (sm_90) backward kernels of varlen THD attention, FlashAttention-3's structure.

Only ``@gluon.jit`` code lives here; grids, tiles and allocation are in ``backward.py``.

Grid convention (as the tl kernels): ``(row tiles, heads, sequences + 1)``; each program first
zeroes its share of the padding rows of its slot, the extra sequence index covers the tail past
the last slot, and row tiles ``first, first + grid0, ...`` follow (more than one only when
``max_seqlen`` underestimates a length).

``_dkdv_kernel``: one program per (key tile, kv head, sequence). A one-warp TMA producer loads the
key tile's K and V once, then streams the Q and dO tiles of every query head of the group into a
``NUM_STAGES`` ring guarded by ``ready`` / ``empty`` mbarriers, each Q tile's rows' ``lse`` and
``delta`` beside it in shared memory (a second arrival on ``ready``): the consumers read them there
when they need them, so none of their registers hold them while the products issue (in registers
they made ptxas spill and serialise ``S^T`` and ``dP^T`` at head dim 128). Its tensor descriptors
are built on the device per sequence with ``real length`` rows (``[L, heads * D]``, a head a column offset),
so rows past a sequence's end arrive as zeros and padding is never read. The consumer warps hold
dK and dV in fp32 registers and per query tile compute ``S^T = K Q^T``,
``P^T = exp2(S^T * scale * log2 e - lse)``, ``dV += P^T dO``, ``dP^T = V dO^T``,
``dS^T = P^T (dP^T - delta) * scale``, ``dK += dS^T Q`` (with ``SOFTCAP``: scores
``softcap * tanh(S^T * scale / softcap)`` and ``dS^T`` times ``1 - tanh^2``)
with async wgmma, and (``DQ_ATOMIC``) add ``dQ = dS K`` to an fp32 buffer: with two consumer
partitions (FA3's way) both partitions' ``dS^T`` meet in shared memory, each computes half of dQ
(its columns, or its query rows) over the whole key tile one query tile late, beside the next
tile's ``dK`` product, and adds it by one TMA reduce-add; with one, by per-element atomics.
``_dq_kernel`` is the split (and deterministic) dQ: one program per (query tile, head, sequence)
streaming K and V the same way, summing key tiles in a fixed order.

Consumers (``NUM_CONSUMERS``): 1 is one partition of ``NUM_WARPS = 8`` warps (two warpgroups
running the same code, synchronised per tile); 2 is two 4-warp partitions (FA3's two consumer
warpgroups), each owning half of the tile's rows and ordered only by the ring's mbarriers (each
arrives on ``empty``), so one's softmax can run under the other's matrix products. Register
budgets: producer ``PRODUCER_REGS`` (24), consumers up to 240 via ``setmaxnreg``.

Visibility: query ``i`` sees key ``j`` iff ``j - i`` lies in ``[d_lo, d_hi]`` (bottom-right
aligned, or by ``positions``), a side bounded only with ``HAS_LEFT`` / ``HAS_RIGHT``; masks are
applied only on tiles that straddle the band's edges or a sequence end. ``lse`` is natural-log.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from thd.ops.attention.geometry import padding_span, sequence_pair, span, visible
from thd.ops.attention.gluon import work_order
from thd.ops.attention.gluon.compat import cta_barrier, tma_load, tma_reduce_add, tma_store_wait
from thd.ops.attention.gluon.tiles import key_tiles, query_tiles, row_descriptor
from thd.ops.attention.softmax_terms import scores_log2, store_delta

__all__ = ["_dkdv_kernel", "_dkdv_persistent_kernel", "_dq_kernel", "_preprocess_kernel"]

LOG2E = gl.constexpr(1.4426950408889634)
# Every 16-bit tile here has rows of 64 or 128 elements (>= 128 bytes): the 128-byte swizzle.
_SMEM_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


# ----------------------------------------------------------------------------- scalar helpers


@gluon.jit
def _zero_padding(
    base_ptr, stride_t, cu_ptr, cup_ptr, b, num_seqs, num_rows,
    WIDTH: gl.constexpr, BLOCK_R: gl.constexpr, NUM_WARPS: gl.constexpr, WHOLE: gl.constexpr = False,
):  # fmt: skip
    """Zero this program's share of the padding rows of slot ``b`` (``b == num_seqs``: the tail past
    the last slot): grid axis 0 splits them, or with ``WHOLE`` this program zeroes them all."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    lo, hi = padding_span(cu_ptr=cu_ptr, cup_ptr=cup_ptr, b=b, num_seqs=num_seqs, num_rows=num_rows)
    offs_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, layout))
    offs_w = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    zero = gl.zeros([BLOCK_R, WIDTH], base_ptr.dtype.element_ty, layout)
    if WHOLE:
        first = lo
        step = BLOCK_R
    else:
        first = lo + gl.program_id(0) * BLOCK_R
        step = gl.num_programs(0) * BLOCK_R
    for row0 in range(first, hi, step):
        rows = gl.expand_dims(row0 + offs_r, 1)
        ptrs = base_ptr + rows.to(gl.int64) * stride_t + gl.expand_dims(offs_w, 0)
        gl.store(ptrs, zero, mask=(rows < hi) & (gl.expand_dims(offs_w, 0) < WIDTH))


@gluon.jit
def _barriers(NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, READY_ARRIVALS: gl.constexpr):
    """The pipeline's mbarriers, initialised and fenced: ``(tile_ready, tile_empty, ready, empty)``
    for the tile loaded once per outer step and for the ``NUM_STAGES`` ring; the empty ones count
    one arrival per consumer partition, the ring's ready ones ``READY_ARRIVALS`` (the copies' and,
    in the dK/dV kernel, the row statistics')."""
    tile_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(tile_ready, count=1)
    mbarrier.init(tile_empty, count=NUM_CONSUMERS)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()
    return tile_ready, tile_empty, ready, empty


# ----------------------------------------------------------------------------- preprocess


@gluon.jit
def _preprocess_kernel(
    out_ptr, do_ptr, delta_ptr, lse_ptr, sinks_ptr, dsink_rows_ptr, cu_q_ptr, cup_q_ptr, rows_q,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_lse_h,
    HEAD_DIM_V: gl.constexpr, HAS_SINKS: gl.constexpr, BLOCK_M: gl.constexpr, NUM_WARPS: gl.constexpr,
):  # fmt: skip
    """``delta = rowsum(out * dout)`` per real row; with sinks also ``-exp(sink - lse) * delta``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    head = gl.program_id(1)
    b = gl.program_id(2)
    q_start, seqlen_q = span(cu_ptr=cu_q_ptr, cup_ptr=cup_q_ptr, b=b, num_rows=rows_q)
    o_base = out_ptr + q_start.to(gl.int64) * stride_ot + head * stride_oh
    do_base = do_ptr + q_start.to(gl.int64) * stride_dot + head * stride_doh
    offs_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_d = gl.expand_dims(gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, layout)), 0)
    for m0 in range(gl.program_id(0) * BLOCK_M, seqlen_q, gl.num_programs(0) * BLOCK_M):
        rows = m0 + offs_r
        rows2 = gl.expand_dims(rows, 1)
        mask = (rows2 < seqlen_q) & (offs_d < HEAD_DIM_V)
        o = gl.load(o_base + rows2 * stride_ot + offs_d, mask=mask, other=0.0)
        do = gl.load(do_base + rows2 * stride_dot + offs_d, mask=mask, other=0.0)
        delta, at = store_delta(
            o=o, do=do, rows=rows, seqlen_q=seqlen_q, q_start=q_start, head=head,
            stride_lse_h=stride_lse_h, delta_ptr=delta_ptr,
        )  # fmt: skip
        if HAS_SINKS:
            lse = gl.load(lse_ptr + at, mask=rows < seqlen_q, other=float("inf"))
            lse = gl.where(lse == float("-inf"), float("inf"), lse)  # a row without any term: p = 0
            sink = gl.load(sinks_ptr + head).to(gl.float32)
            gl.store(dsink_rows_ptr + at, -gl.exp(sink - lse) * delta, mask=rows < seqlen_q)


# ----------------------------------------------------------------------------- dK / dV (+ dQ atomics)


@gluon.jit
def _dkdv_key_tile_loads(
    k_desc, v_desc, q_desc, do_desc, tile, buffers, it, j,
    GROUP: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
):  # fmt: skip
    """The copies of key tile ``n0`` (the program's ``j``-th): K and V once the consumers are done
    with the previous one, then Q and dO of every visible query tile of each head of the group, and
    beside each Q tile its rows' ``lse`` (log2 domain, ``+inf`` where no key was seen or past the
    sequence: P = 0 there) and ``delta`` into the stage's ``stats`` (the second arrival on
    ``ready``), so the consumers keep no registers of them while their products issue. Returns the
    ring's next stage count ``it``."""
    n0, seqlen_q, seqlen_k, d_lo, d_hi, kv_head, q_start, lse_ptr, delta_ptr, stride_lse_h = tile
    k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty, lse_smem, delta_smem = buffers
    stat_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[1]
    NUM_STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    mbarrier.wait(kv_empty, (j & 1) ^ 1)
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [n0, kv_head * HEAD_DIM], kv_ready, k_smem)
    tma_load(v_desc, [n0, kv_head * HEAD_DIM], kv_ready, v_smem)
    a, _, _, end = query_tiles(n0, seqlen_k, seqlen_q, d_lo, d_hi, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for g in range(GROUP):
        col = (kv_head * GROUP + g) * HEAD_DIM
        for m0 in range(a, end, BLOCK_M):
            stage = it % NUM_STAGES
            mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma_load(q_desc, [m0, col], bar, q_smem.index(stage))
            tma_load(do_desc, [m0, col], bar, do_smem.index(stage))
            rows = m0 + gl.arange(0, BLOCK_M, layout=stat_layout)
            at = (kv_head * GROUP + g) * stride_lse_h + q_start + rows
            lse = gl.load(lse_ptr + at, mask=rows < seqlen_q, other=float("inf"))
            lse_smem.index(stage).store(gl.where(lse == float("-inf"), float("inf"), lse) * LOG2E)
            delta_smem.index(stage).store(gl.load(delta_ptr + at, mask=rows < seqlen_q, other=0.0))
            mbarrier.arrive(bar)  # the statistics are in place (the copies arrive by their bytes)
            it += 1
    return it


@gluon.jit
def _dkdv_descriptors(
    q_base, do_base, k_base, v_base, stride_qt, stride_dot, stride_kt, stride_vt, seqlen_q, seqlen_k,
    kv_head, k_smem, q_smem, GROUP: gl.constexpr,
):  # fmt: skip
    """``(k, v, q, do)`` descriptors over one sequence's ``[length, heads * D]`` rows (heads adjacent
    in a row, up to this kv head's group), read in the shared buffers' tiles: rows past the
    sequence load as zeros."""
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[1]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    smem: gl.constexpr = _SMEM_LAYOUT
    width_kv = (kv_head + 1) * HEAD_DIM
    width_q = width_kv * GROUP
    k_desc = row_descriptor(k_base, seqlen_k, width_kv, stride_kt, BLOCK_N, HEAD_DIM, smem)
    v_desc = row_descriptor(v_base, seqlen_k, width_kv, stride_vt, BLOCK_N, HEAD_DIM, smem)
    q_desc = row_descriptor(q_base, seqlen_q, width_q, stride_qt, BLOCK_M, HEAD_DIM, smem)
    do_desc = row_descriptor(do_base, seqlen_q, width_q, stride_dot, BLOCK_M, HEAD_DIM, smem)
    return k_desc, v_desc, q_desc, do_desc


@gluon.jit
def _dkdv_item_loads(
    item, buffers, it, j, GROUP: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr
):
    """A persistent program's work item: the four descriptors over its sequence's ``[length,
    heads * D]`` rows (built at each call site of this function: one set per site), then
    :func:`_dkdv_key_tile_loads`."""
    (
        q_ptr, do_ptr, k_ptr, v_ptr, stride_qt, stride_dot, stride_kt, stride_vt, kv_head, n0, q_start,
        seqlen_q, k_start, seqlen_k, d_lo, d_hi, lse_ptr, delta_ptr, stride_lse_h,
    ) = item  # fmt: skip
    k_smem, _, q_smem, _, _, _, _, _, _, _ = buffers
    k_desc, v_desc, q_desc, do_desc = _dkdv_descriptors(
        q_ptr + q_start.to(gl.int64) * stride_qt, do_ptr + q_start.to(gl.int64) * stride_dot,
        k_ptr + k_start.to(gl.int64) * stride_kt, v_ptr + k_start.to(gl.int64) * stride_vt, stride_qt,
        stride_dot, stride_kt, stride_vt, seqlen_q, seqlen_k, kv_head, k_smem, q_smem, GROUP,
    )  # fmt: skip
    tile = (n0, seqlen_q, seqlen_k, d_lo, d_hi, kv_head, q_start, lse_ptr, delta_ptr, stride_lse_h)
    return _dkdv_key_tile_loads(
        k_desc, v_desc, q_desc, do_desc, tile, buffers, it, j, GROUP, HAS_LEFT, HAS_RIGHT
    )


@gluon.jit
def _dkdv_producer(args, GROUP: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """TMA loads of this program's key tiles (:func:`_dkdv_key_tile_loads`) of one sequence and kv
    head. One descriptor per tensor over this sequence's ``[length, heads * D]`` rows (heads
    adjacent in a row); a head is a column offset, so no descriptor is rebuilt while copies are in
    flight."""
    (
        q_base, do_base, k_base, v_base, stride_qt, stride_dot, stride_kt, stride_vt, seqlen_q, seqlen_k,
        d_lo, d_hi, kv_head, first, step, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty,
        lse_ptr, delta_ptr, stride_lse_h, q_start, lse_smem, delta_smem,
    ) = args  # fmt: skip
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    k_desc, v_desc, q_desc, do_desc = _dkdv_descriptors(
        q_base, do_base, k_base, v_base, stride_qt, stride_dot, stride_kt, stride_vt, seqlen_q, seqlen_k,
        kv_head, k_smem, q_smem, GROUP,
    )  # fmt: skip
    buffers = (k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty, lse_smem, delta_smem)
    it = 0
    j = 0
    for n_block in range(first, gl.cdiv(seqlen_k, BLOCK_N), step):
        tile = (
            n_block * BLOCK_N, seqlen_q, seqlen_k, d_lo, d_hi, kv_head, q_start, lse_ptr, delta_ptr,
            stride_lse_h,
        )  # fmt: skip
        it = _dkdv_key_tile_loads(
            k_desc, v_desc, q_desc, do_desc, tile, buffers, it, j, GROUP, HAS_LEFT, HAS_RIGHT
        )
        j += 1  # noqa: SIM113 -- no enumerate in a kernel


@gluon.jit
def _dkdv_work_item(w, total, work, BLOCK_N: gl.constexpr, HAS_POSITIONS: gl.constexpr):
    """A persistent program's work item ``w`` of ``total``: ``(kv_head, n0, q_start, seqlen_q,
    k_start, seqlen_k, d_lo, d_hi)``. The list (``schedule.build_work_list`` over the key tiles)
    holds tile ``blk`` of each sequence, highest first; ``blk`` names key tile ``tiles - 1 - blk``,
    so the key tiles that see the most query tiles under a causal mask come first."""
    (
        seq_ptr, blk_ptr, num_kv_heads, head_section, serpentine, cu_q_ptr, cup_q_ptr, cu_k_ptr, cup_k_ptr,
        pos_q_ptr, pos_k_ptr, rows_q, rows_k, window_left, window_right,
    ) = work  # fmt: skip
    item, kv_head = work_order.item_and_head(w, total, num_kv_heads, head_section, serpentine)
    b = gl.load(seq_ptr + item)
    q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = sequence_pair(
        cu_q_ptr, cup_q_ptr, cu_k_ptr, cup_k_ptr, pos_q_ptr, pos_k_ptr, b, rows_q, rows_k, window_left,
        window_right, HAS_POSITIONS,
    )  # fmt: skip
    n0 = (gl.cdiv(seqlen_k, BLOCK_N) - 1 - gl.load(blk_ptr + item)) * BLOCK_N
    return kv_head, n0, q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi


@gluon.jit
def _dkdv_persistent_producer(
    args, work, GROUP: gl.constexpr, HAS_POSITIONS: gl.constexpr, HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr, DYNAMIC: gl.constexpr,
):  # fmt: skip
    """TMA loads of a persistent program's work items, every ``G``-th of the list, or with
    ``DYNAMIC`` each next one from the global ticket (drawn one item ahead), handed to the
    consumers through the item slots, then the end. Publishing item ``j`` in slot ``j & 1`` is safe
    once item ``j - 1``'s copies are issued: they waited for the consumers to release item ``j - 2``,
    whose slot they had read. An item's descriptors are written before it waits for the consumers
    to release the previous item's K/V, alternately at two call sites (two descriptor sets): the
    set it rewrites served the item before the previous one, whose copies have all landed (the
    previous item waited for its release)."""
    (
        q_ptr, do_ptr, k_ptr, v_ptr, stride_qt, stride_dot, stride_kt, stride_vt, lse_ptr, delta_ptr,
        stride_lse_h, total, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty,
        lse_smem, delta_smem, items, item_bars, ticket_ptr,
    ) = args  # fmt: skip
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    buffers = (k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty, lse_smem, delta_smem)
    it = 0
    j = 0
    w = work_order.fetch_add(ticket_ptr, "relaxed") if DYNAMIC else gl.program_id(0)
    while w < total:
        if DYNAMIC:
            work_order.publish_item(items, item_bars, j & 1, w)
            w_next = work_order.fetch_add(ticket_ptr, "relaxed")
        else:
            w_next = w + gl.num_programs(0)
        kv_head, n0, q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = _dkdv_work_item(
            w, total, work, BLOCK_N, HAS_POSITIONS
        )
        item = (
            q_ptr, do_ptr, k_ptr, v_ptr, stride_qt, stride_dot, stride_kt, stride_vt, kv_head, n0, q_start,
            seqlen_q, k_start, seqlen_k, d_lo, d_hi, lse_ptr, delta_ptr, stride_lse_h,
        )  # fmt: skip
        if (j & 1) == 0:
            it = _dkdv_item_loads(item, buffers, it, j, GROUP, HAS_LEFT, HAS_RIGHT)
        else:
            it = _dkdv_item_loads(item, buffers, it, j, GROUP, HAS_LEFT, HAS_RIGHT)
        j += 1
        w = w_next
    if DYNAMIC:  # the end (w >= total)
        work_order.publish_item(items, item_bars, j & 1, w)


@gluon.jit
def _dq_reduce_descriptor(
    dq_ptr, q_start, seqlen_q, kv_head, stride_dqt, GROUP: gl.constexpr, dq_smem, HEAD_DIM: gl.constexpr
):
    """The TMA reduce-add descriptor of the fp32 dQ rows of one sequence (heads adjacent in a row)
    in a consumer partition's tiles, ``dq_smem``'s: ``[BLOCK_M, D / 2]`` (its columns) or, with
    ``DQ_ROWS``, ``[BLOCK_M / 2, D]`` (its query rows)."""
    DQ_M: gl.constexpr = dq_smem.shape[1]
    DQ_COLS: gl.constexpr = dq_smem.shape[2]
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DQ_M, DQ_COLS], gl.float32)
    return row_descriptor(
        dq_ptr + q_start.to(gl.int64) * stride_dqt, seqlen_q, (kv_head + 1) * GROUP * HEAD_DIM,
        stride_dqt, DQ_M, DQ_COLS, layout,
    )  # fmt: skip


@gluon.jit
def _dq_product(ds_smem, tile_it, dq_cols, dq_acc, WG: gl.constexpr, DQ_ROWS: gl.constexpr):
    """Issues (async) this partition's part of ``dQ = dS K`` for the query tile the ring served as
    stage count ``tile_it`` (both halves of its ``dS^T`` in shared memory: the caller waited)."""
    ds_tile = ds_smem.index(tile_it % 2)
    if DQ_ROWS:  # A: this partition's query rows of dS
        DQ_M: gl.constexpr = dq_acc.shape[0]
        ds_tile = ds_tile.slice(WG * DQ_M, DQ_M, dim=1)
    return warpgroup_mma(ds_tile.permute((1, 0)), dq_cols, dq_acc, use_acc=False, is_async=True)


@gluon.jit
def _dq_reduce_add(dq, ds_bars, tile_it, dq_tile, dq_desc, row, col):
    """Once every warp's dQ product of stage count ``tile_it`` is done (its ``dS^T`` buffer then
    free for tile ``tile_it + 2``) and the previous reduction has read ``dq_tile``: adds ``dq`` at
    ``[row, col]`` of the fp32 dQ rows by one TMA reduce-add from ``dq_tile``."""
    tma_store_wait(0)
    cta_barrier()
    mbarrier.arrive(ds_bars.index(2 + tile_it % 2))
    dq_tile.store(dq)
    fence_async_shared()
    cta_barrier()  # every warp's part of the tile is in place
    tma_reduce_add(dq_desc, [row, col], dq_tile)


@gluon.jit
def _dkdv_key_tile(
    dq_desc, tile, buffers, it, j,
    GROUP: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, ACCUMULATE: gl.constexpr,
    DQ_ATOMIC: gl.constexpr, NUM_CONSUMERS: gl.constexpr, WG: gl.constexpr, SOFTCAP: gl.constexpr,
    DQ_ROWS: gl.constexpr,
):  # fmt: skip
    """dK and dV of key rows ``[n0 + WG * WG_ROWS, n0 + (WG + 1) * WG_ROWS)`` in registers over every
    visible query tile of the group's heads (``WG_ROWS = BLOCK_N / NUM_CONSUMERS``), stored (or
    added) at the end; the key tile is the program's ``j``-th. ``DQ_ATOMIC``: dQ of each query tile
    added to fp32 ``dq`` as well. One partition: ``dQ = dS K`` by both warpgroups, added by
    per-element atomics. Two partitions (FA3's): each stores its rows of ``dS^T`` in shared memory
    (``ds_bars`` 0-1: both halves stored), and one query tile later, beside the next tile's dK
    product (so neither waits for the other's half in the same tile), computes its half of dQ's
    columns over all the tile's keys and adds it with one TMA reduce-add by ``dq_desc`` from
    ``dq_smem`` (rows past the sequence are dropped by the descriptor); ``ds_bars`` 2-3 say when both
    partitions' dQ products have read a buffer, before it takes tile ``it + 2``'s halves. With
    ``DQ_ROWS`` each computes dQ of its half of the query rows over every column instead (FA3's
    split at head dim 64: wgmma of N = D, not D / 2).
    ``SOFTCAP``: scores ``softcap * tanh(S * scale / softcap)``, dS times ``1 - tanh^2``. Returns
    the ring's next stage count ``it``."""
    (
        n0, dk_base, dv_base, dq_ptr, stride_dkt, stride_dvt, stride_dqt, stride_dqh, q_start, seqlen_q,
        seqlen_k, d_lo, d_hi, kv_head, sm_scale, softcap,
    ) = tile  # fmt: skip
    (
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty,
        lse_smem, delta_smem,
    ) = buffers  # fmt: skip
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[1]
    NUM_STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    WG_ROWS: gl.constexpr = BLOCK_N // NUM_CONSUMERS
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    if WG_ROWS == BLOCK_N:
        k_rows = k_smem
        v_rows = v_smem
    else:
        k_rows = k_smem.slice(WG * WG_ROWS, WG_ROWS)
        v_rows = v_smem.slice(WG * WG_ROWS, WG_ROWS)
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    # this partition's dQ: DQ_M x DQ_COLS at (WG * DQ_ROW0, WG * DQ_COL0) of the query tile's
    if DQ_ROWS:
        DQ_M: gl.constexpr = BLOCK_M // NUM_CONSUMERS
        DQ_COLS: gl.constexpr = HEAD_DIM
        DQ_ROW0: gl.constexpr = DQ_M
        DQ_COL0: gl.constexpr = 0
    else:
        DQ_M: gl.constexpr = BLOCK_M
        DQ_COLS: gl.constexpr = HEAD_DIM // NUM_CONSUMERS
        DQ_ROW0: gl.constexpr = 0
        DQ_COL0: gl.constexpr = DQ_COLS
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4], instr_shape=[16, DQ_COLS // (NUM_WARPS // 4), 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    stat_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a value per query (a column of S^T)
    dq_add_layout: gl.constexpr = gl.BlockedLayout(
        [1, 4], [128 // HEAD_DIM, HEAD_DIM // 4], [NUM_WARPS, 1], [1, 0]
    )
    zero_st = gl.zeros([WG_ROWS, BLOCK_M], gl.float32, s_layout)  # S^T and dP^T start from nothing
    if DQ_ATOMIC:
        if NUM_CONSUMERS == 2:
            dq_tile = dq_smem.index(WG)
            # B of this partition's dQ: every column (DQ_ROWS) or its columns
            dq_cols = k_smem if DQ_ROWS else k_smem.slice(WG * DQ_COLS, DQ_COLS, dim=1)
        else:
            dq_cols = k_rows
    own0 = n0 + WG * WG_ROWS
    cols = gl.expand_dims(own0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout)), 1)
    a, b_, c, end = query_tiles(n0, seqlen_k, seqlen_q, d_lo, d_hi, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dk = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_ready, j & 1)
    # two partitions: a query tile's dQ product waits for the other partition's half of its dS^T, so
    # it is issued one query tile late, beside the next tile's dK product (pending: that tile's
    # stage count, row and head; -1: none)
    pending_it = -1
    pending_m0 = 0
    pending_head = 0
    for g in range(GROUP):
        head = kv_head * GROUP + g
        dq_base = dq_ptr + q_start.to(gl.int64) * stride_dqt + head * stride_dqh
        for m0 in range(a, end, BLOCK_M):
            stage = it % NUM_STAGES
            mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
            q_tile = q_smem.index(stage)
            do_tile = do_smem.index(stage)
            s_tok = warpgroup_mma(k_rows, q_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(v_rows, do_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            lse = lse_smem.index(stage).load(stat_layout)
            s, t = scores_log2(s, sm_scale, softcap, SOFTCAP)
            p = gl.exp2(s - gl.expand_dims(lse, 0))
            if (m0 < b_) | (m0 >= c):
                rows_1d = m0 + gl.arange(0, BLOCK_M, layout=stat_layout)
                rows = gl.expand_dims(rows_1d, 0)
                p = gl.where(visible(rows, cols, seqlen_k, d_lo, d_hi, HAS_LEFT, HAS_RIGHT), p, 0.0)
            p_op = gl.convert_layout(p.to(dtype), a_layout)
            if SOFTCAP:  # from here p only scales dS: fold the tanh's derivative in, so t dies here
                p = p * (1.0 - t * t)
            dv_tok = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp_tok,))
            delta = delta_smem.index(stage).load(stat_layout)
            ds = (p * (dp - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)
            if DQ_ATOMIC:  # dS^T in shared memory (double-buffered): the A operand of dQ = dS K
                ds_tile = ds_smem.index(it % 2)
                if NUM_CONSUMERS == 2:
                    if it >= 2:  # both partitions' dQ products of stage count it - 2 read this buffer
                        mbarrier.wait(ds_bars.index(2 + it % 2), ((it // 2) & 1) ^ 1)
                    ds_tile.slice(WG * WG_ROWS, WG_ROWS).store(ds)
                else:
                    ds_tile.store(ds)
                fence_async_shared()
                cta_barrier()  # every warp's rows of dS^T are in place
                if NUM_CONSUMERS == 2:
                    mbarrier.arrive(ds_bars.index(it % 2))
            dk_tok = warpgroup_mma(gl.convert_layout(ds, a_layout), q_tile, dk, is_async=True)
            if DQ_ATOMIC and NUM_CONSUMERS == 2:  # the previous query tile's dQ beside this dK
                has_pending = pending_it >= 0
                if has_pending:  # the other partition's half of its dS^T is in place
                    mbarrier.wait(ds_bars.index(pending_it % 2), (pending_it // 2) & 1)
                dq_tok = _dq_product(
                    ds_smem,
                    gl.maximum(pending_it, 0),
                    dq_cols,
                    gl.zeros([DQ_M, DQ_COLS], gl.float32, dq_layout),
                    WG,
                    DQ_ROWS,
                )
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
                if has_pending:  # (without one the product read a stale buffer: dropped)
                    _dq_reduce_add(
                        dq,
                        ds_bars,
                        pending_it,
                        dq_tile,
                        dq_desc,
                        pending_m0 + WG * DQ_ROW0,
                        pending_head * HEAD_DIM + WG * DQ_COL0,
                    )
                pending_it = it
                pending_m0 = m0
                pending_head = head
            elif DQ_ATOMIC:  # one partition: dQ = dS K at once, added by per-element atomics
                dq_tok = warpgroup_mma(
                    ds_tile.permute((1, 0)),
                    dq_cols,
                    gl.zeros([DQ_M, DQ_COLS], gl.float32, dq_layout),
                    use_acc=False,
                    is_async=True,
                )
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
            else:
                dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
            cta_barrier()  # every warp of this partition is done with this stage
            mbarrier.arrive(empty.index(stage))
            if DQ_ATOMIC and NUM_CONSUMERS == 1:  # through shared memory into rows of 4-wide atomics
                dq = gl.convert_layout(dq, dq_add_layout)
                dq_rows = gl.expand_dims(
                    m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_add_layout)), 1
                )
                offs_d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_add_layout)), 0)
                gl.atomic_add(
                    dq_base + dq_rows * stride_dqt + offs_d,
                    dq,
                    mask=(dq_rows < seqlen_q) & (offs_d < HEAD_DIM),
                    sem="relaxed",
                )
            it += 1
    if DQ_ATOMIC and NUM_CONSUMERS == 2:  # noqa: SIM102 -- a constexpr gate, then the last query tile's dQ
        if pending_it >= 0:
            mbarrier.wait(ds_bars.index(pending_it % 2), (pending_it // 2) & 1)
            dq_tok = _dq_product(
                ds_smem,
                pending_it,
                dq_cols,
                gl.zeros([DQ_M, DQ_COLS], gl.float32, dq_layout),
                WG,
                DQ_ROWS,
            )
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            _dq_reduce_add(
                dq, ds_bars, pending_it, dq_tile, dq_desc, pending_m0 + WG * DQ_ROW0,
                pending_head * HEAD_DIM + WG * DQ_COL0,
            )  # fmt: skip
    cta_barrier()
    mbarrier.arrive(kv_empty)
    out_rows = gl.expand_dims(own0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, kv_layout)), 1)
    offs_d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout)), 0)
    mask = (out_rows < seqlen_k) & (offs_d < HEAD_DIM)
    dk_ptrs = dk_base + out_rows.to(gl.int64) * stride_dkt + offs_d
    dv_ptrs = dv_base + out_rows.to(gl.int64) * stride_dvt + offs_d
    if ACCUMULATE:  # add this launch's part to what the rows hold
        dk += gl.load(dk_ptrs, mask=mask, other=0.0).to(gl.float32)
        dv += gl.load(dv_ptrs, mask=mask, other=0.0).to(gl.float32)
    gl.store(dk_ptrs, dk.to(dk_base.dtype.element_ty), mask=mask)
    gl.store(dv_ptrs, dv.to(dv_base.dtype.element_ty), mask=mask)
    return it


@gluon.jit
def _dkdv_consumer(
    args,
    GROUP: gl.constexpr,
    HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    DQ_ATOMIC: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    WG: gl.constexpr,
    SOFTCAP: gl.constexpr,
    DQ_ROWS: gl.constexpr,
):
    """:func:`_dkdv_key_tile` over this program's key tiles of one sequence and kv head."""
    (
        dk_base, dv_base, dq_ptr, stride_dkt, stride_dvt, stride_dqt, stride_dqh, q_start, seqlen_q,
        seqlen_k, d_lo, d_hi, kv_head, first, step, sm_scale, softcap, k_smem, v_smem, q_smem, do_smem,
        ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty, lse_smem, delta_smem,
    ) = args  # fmt: skip
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    buffers = (
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty,
        lse_smem, delta_smem,
    )  # fmt: skip
    if DQ_ATOMIC and NUM_CONSUMERS == 2:  # dQ rows of this sequence, heads adjacent in a row, fp32
        dq_desc = _dq_reduce_descriptor(
            dq_ptr, q_start, seqlen_q, kv_head, stride_dqt, GROUP, dq_smem, k_smem.shape[1]
        )
    else:
        dq_desc = dq_ptr  # unused
    it = 0
    j = 0
    for n_block in range(first, gl.cdiv(seqlen_k, BLOCK_N), step):
        tile = (
            n_block * BLOCK_N, dk_base, dv_base, dq_ptr, stride_dkt, stride_dvt, stride_dqt, stride_dqh,
            q_start, seqlen_q, seqlen_k, d_lo, d_hi, kv_head, sm_scale, softcap,
        )  # fmt: skip
        it = _dkdv_key_tile(
            dq_desc, tile, buffers, it, j, GROUP, HAS_LEFT, HAS_RIGHT, ACCUMULATE, DQ_ATOMIC,
            NUM_CONSUMERS, WG, SOFTCAP, DQ_ROWS,
        )  # fmt: skip
        j += 1  # noqa: SIM113 -- no enumerate in a kernel
    if DQ_ATOMIC and NUM_CONSUMERS == 2:
        tma_store_wait(0)  # dq_smem stays allocated until the last reduction has read it


@gluon.jit
def _dkdv_persistent_consumer(
    args,
    work,
    GROUP: gl.constexpr,
    HAS_POSITIONS: gl.constexpr,
    HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    DQ_ATOMIC: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    WG: gl.constexpr,
    DYNAMIC: gl.constexpr,
    SOFTCAP: gl.constexpr,
    DQ_ROWS: gl.constexpr,
):
    """:func:`_dkdv_key_tile` over a persistent program's work items (:func:`_dkdv_work_item`),
    every ``G``-th of the list or, with ``DYNAMIC``, those its producer publishes, as its producer
    takes them. The dQ reduce-add descriptor is rebuilt per item once the previous item's
    reductions have read it."""
    (
        dk_ptr, dv_ptr, dq_ptr, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
        sm_scale, softcap, total, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready,
        kv_empty, ready, empty, lse_smem, delta_smem, items, item_bars, ticket_ptr,
    ) = args  # fmt: skip
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    buffers = (
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty,
        lse_smem, delta_smem,
    )  # fmt: skip
    it = 0
    j = 0
    w = work_order.take_item(items, item_bars, j) if DYNAMIC else gl.program_id(0)
    while w < total:
        kv_head, n0, q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = _dkdv_work_item(
            w, total, work, BLOCK_N, HAS_POSITIONS
        )
        dk_base = dk_ptr + kv_head * stride_dkh + k_start.to(gl.int64) * stride_dkt
        dv_base = dv_ptr + kv_head * stride_dvh + k_start.to(gl.int64) * stride_dvt
        if DQ_ATOMIC and NUM_CONSUMERS == 2:
            tma_store_wait(0)  # the previous item's reductions have read its descriptor
            cta_barrier()
            dq_desc = _dq_reduce_descriptor(
                dq_ptr, q_start, seqlen_q, kv_head, stride_dqt, GROUP, dq_smem, k_smem.shape[1]
            )
        else:
            dq_desc = dq_ptr  # unused
        tile = (
            n0, dk_base, dv_base, dq_ptr, stride_dkt, stride_dvt, stride_dqt, stride_dqh, q_start, seqlen_q,
            seqlen_k, d_lo, d_hi, kv_head, sm_scale, softcap,
        )  # fmt: skip
        it = _dkdv_key_tile(
            dq_desc, tile, buffers, it, j, GROUP, HAS_LEFT, HAS_RIGHT, ACCUMULATE, DQ_ATOMIC,
            NUM_CONSUMERS, WG, SOFTCAP, DQ_ROWS,
        )  # fmt: skip
        j += 1
        w = work_order.take_item(items, item_bars, j) if DYNAMIC else w + gl.num_programs(0)
    if DQ_ATOMIC and NUM_CONSUMERS == 2:
        tma_store_wait(0)  # dq_smem stays allocated until the last reduction has read it
    if DYNAMIC and WG == 0:  # this program's producer took its last ticket
        work_order.retire_program(ticket_ptr)


@gluon.jit
def _dkdv_buffers(
    dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, DQ_ATOMIC: gl.constexpr, DQ_ROWS: gl.constexpr,
):  # fmt: skip
    """The dK/dV kernels' shared memory and mbarriers, initialised: ``(k, v, q, do, ds, dq, ds_bars,
    kv_ready, kv_empty, ready, empty, lse, delta)`` (``ds``, ``dq`` and ``ds_bars`` stand in, unused,
    where the call has no use for them)."""
    smem: gl.constexpr = _SMEM_LAYOUT
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], smem)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], smem)
    # dS^T of the tile, double-buffered: the A operand of dQ = dS K (unused without DQ_ATOMIC)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], smem) if DQ_ATOMIC else k_smem
    kv_ready, kv_empty, ready, empty = _barriers(
        NUM_STAGES=NUM_STAGES, NUM_CONSUMERS=NUM_CONSUMERS, READY_ARRIVALS=2
    )
    # each stage's query rows' lse and delta (written by the producer warp, read by the consumers)
    stat_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stat_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stat_smem)
    if DQ_ATOMIC and NUM_CONSUMERS == 2:  # each partition's dQ tile, the source of its TMA reduce-add
        if DQ_ROWS:  # half the query rows, every column
            DQ_M: gl.constexpr = BLOCK_M // 2
            DQ_COLS: gl.constexpr = HEAD_DIM
        else:  # every query row, half the columns
            DQ_M: gl.constexpr = BLOCK_M
            DQ_COLS: gl.constexpr = HEAD_DIM // 2
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DQ_M, DQ_COLS], gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, DQ_M, DQ_COLS], dq_layout)
        # per dS^T buffer: 0, 1 both halves stored; 2, 3 read by both partitions' dQ products
        ds_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4):
            mbarrier.init(ds_bars.index(i), count=2)
        fence_async_shared()
    else:
        dq_smem = k_smem  # unused
        ds_bars = kv_ready  # unused
    return (
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty,
        lse_smem, delta_smem,
    )  # fmt: skip


@gluon.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, cu_q_ptr, cu_k_ptr, cup_q_ptr,
    cup_k_ptr, pos_q_ptr, pos_k_ptr, rows_q, rows_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt,
    stride_dqh, stride_lse_h, sm_scale, softcap, window_left, window_right, GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr, HAS_POSITIONS: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ACCUMULATE: gl.constexpr, DQ_ATOMIC: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DQ_ROWS: gl.constexpr,
):  # fmt: skip
    kv_head = gl.program_id(1)
    b = gl.program_id(2)
    num_seqs = gl.num_programs(2) - 1
    dk_head = dk_ptr + kv_head * stride_dkh
    dv_head = dv_ptr + kv_head * stride_dvh
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        _zero_padding(
            dk_head, stride_dkt, cu_k_ptr, cup_k_ptr, b, num_seqs, rows_k, HEAD_DIM, BLOCK_N,
            NUM_WARPS,
        )  # fmt: skip
        _zero_padding(
            dv_head, stride_dvt, cu_k_ptr, cup_k_ptr, b, num_seqs, rows_k, HEAD_DIM, BLOCK_N,
            NUM_WARPS,
        )  # fmt: skip
    if b == num_seqs:
        return
    q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = sequence_pair(
        cu_q_ptr, cup_q_ptr, cu_k_ptr, cup_k_ptr, pos_q_ptr, pos_k_ptr, b, rows_q, rows_k, window_left,
        window_right, HAS_POSITIONS,
    )  # fmt: skip
    if gl.program_id(0) >= gl.cdiv(seqlen_k, BLOCK_N):  # no key tile of its own: both partitions' loops
        return  # would be empty, so skip their start (a grid sized by max_seqlen_kv has many such)
    (
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty,
        lse_smem, delta_smem,
    ) = _dkdv_buffers(
        q_ptr.dtype.element_ty, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, DQ_ATOMIC, DQ_ROWS
    )  # fmt: skip
    dk_base = dk_head + k_start.to(gl.int64) * stride_dkt
    dv_base = dv_head + k_start.to(gl.int64) * stride_dvt
    first = gl.program_id(0)
    step = gl.num_programs(0)
    consumer = (
        dk_base, dv_base, dq_ptr, stride_dkt, stride_dvt, stride_dqt, stride_dqh, q_start, seqlen_q,
        seqlen_k, d_lo, d_hi, kv_head, first, step, sm_scale, softcap, k_smem, v_smem, q_smem, do_smem,
        ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty, lse_smem, delta_smem,
    )  # fmt: skip
    producer = (
        q_ptr + q_start.to(gl.int64) * stride_qt, do_ptr + q_start.to(gl.int64) * stride_dot,
        k_ptr + k_start.to(gl.int64) * stride_kt, v_ptr + k_start.to(gl.int64) * stride_vt, stride_qt,
        stride_dot, stride_kt, stride_vt, seqlen_q, seqlen_k, d_lo, d_hi, kv_head, first, step, k_smem,
        v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty, lse_ptr, delta_ptr, stride_lse_h, q_start,
        lse_smem, delta_smem,
    )  # fmt: skip
    if NUM_CONSUMERS == 1:
        gl.warp_specialize(
            [
                (_dkdv_consumer, (consumer, GROUP, HAS_LEFT, HAS_RIGHT, ACCUMULATE, DQ_ATOMIC, 1, 0,
                                  SOFTCAP, DQ_ROWS)),
                (_dkdv_producer, (producer, GROUP, HAS_LEFT, HAS_RIGHT)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip
    else:  # two consumer warpgroups, each its half of the key tile, ordered only by the ring
        gl.warp_specialize(
            [
                (_dkdv_consumer, (consumer, GROUP, HAS_LEFT, HAS_RIGHT, ACCUMULATE, DQ_ATOMIC, 2, 0,
                                  SOFTCAP, DQ_ROWS)),
                (_dkdv_consumer, (consumer, GROUP, HAS_LEFT, HAS_RIGHT, ACCUMULATE, DQ_ATOMIC, 2, 1,
                                  SOFTCAP, DQ_ROWS)),
                (_dkdv_producer, (producer, GROUP, HAS_LEFT, HAS_RIGHT)),
            ],
            [NUM_WARPS, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


@gluon.jit
def _dkdv_persistent_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, cu_q_ptr, cu_k_ptr, cup_q_ptr,
    cup_k_ptr, pos_q_ptr, pos_k_ptr, seq_ptr, blk_ptr, count_ptr, rows_q, rows_k, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt,
    stride_dvh, stride_dqt, stride_dqh, stride_lse_h, sm_scale, softcap, window_left, window_right,
    num_seqs, num_kv_heads, head_section, serpentine, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_POSITIONS: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    ACCUMULATE: gl.constexpr, DQ_ATOMIC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SLOTS: gl.constexpr, DYNAMIC: gl.constexpr,
    DQ_ROWS: gl.constexpr,
):  # fmt: skip
    """``_dkdv_kernel``'s work on ``G`` persistent programs: each takes every ``G``-th item of the
    key tiles' work list (``count_ptr[0]`` tiles times the kv heads, :func:`_dkdv_work_item`) or,
    with ``DYNAMIC``, the next unclaimed one whenever its producer is ready for one (the ticket
    ``count_ptr[1]``, zeroed by ``build_work_list`` and left at zero by the launch), so no
    program starts for a tile that does not exist, the next item's descriptors are built under this
    one's products and its copies start once the consumers release K/V, under their epilogue
    (stores of dK/dV). The programs first zero the padding rows of dK and dV between them, (slot, kv head)
    pairs round robin; without ``SLOTS`` (packed key offsets) only the tail past the last sequence
    can hold padding."""
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        first_job = 0 if SLOTS else num_seqs * num_kv_heads
        for job in range(first_job + gl.program_id(0), (num_seqs + 1) * num_kv_heads, gl.num_programs(0)):
            b = job // num_kv_heads
            head = job - b * num_kv_heads
            _zero_padding(
                dk_ptr + head * stride_dkh, stride_dkt, cu_k_ptr, cup_k_ptr, b, num_seqs, rows_k, HEAD_DIM,
                BLOCK_N, NUM_WARPS, True,
            )  # fmt: skip
            _zero_padding(
                dv_ptr + head * stride_dvh, stride_dvt, cu_k_ptr, cup_k_ptr, b, num_seqs, rows_k, HEAD_DIM,
                BLOCK_N, NUM_WARPS, True,
            )  # fmt: skip
    total = gl.load(count_ptr) * num_kv_heads
    if not DYNAMIC:  # noqa: SIM102 (constexpr, then runtime): a dynamic program runs to retire itself
        if gl.program_id(0) >= total:
            return
    (
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready, kv_empty, ready, empty,
        lse_smem, delta_smem,
    ) = _dkdv_buffers(
        q_ptr.dtype.element_ty, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, DQ_ATOMIC, DQ_ROWS
    )  # fmt: skip
    # DYNAMIC: the producer's work items for the consumers, by item parity
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if DYNAMIC:
        for i in gl.static_range(2):
            mbarrier.init(item_bars.index(i), count=1)
        fence_async_shared()
    work = (
        seq_ptr, blk_ptr, num_kv_heads, head_section, serpentine, cu_q_ptr, cup_q_ptr, cu_k_ptr, cup_k_ptr,
        pos_q_ptr, pos_k_ptr, rows_q, rows_k, window_left, window_right,
    )  # fmt: skip
    consumer = (
        dk_ptr, dv_ptr, dq_ptr, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
        sm_scale, softcap, total, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, ds_bars, kv_ready,
        kv_empty, ready, empty, lse_smem, delta_smem, items, item_bars, count_ptr + 1,
    )  # fmt: skip
    producer = (
        q_ptr, do_ptr, k_ptr, v_ptr, stride_qt, stride_dot, stride_kt, stride_vt, lse_ptr, delta_ptr,
        stride_lse_h, total, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty, lse_smem,
        delta_smem, items, item_bars, count_ptr + 1,
    )  # fmt: skip
    if NUM_CONSUMERS == 1:
        gl.warp_specialize(
            [
                (_dkdv_persistent_consumer, (consumer, work, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT,
                                             ACCUMULATE, DQ_ATOMIC, 1, 0, DYNAMIC, SOFTCAP,
                                             DQ_ROWS)),
                (_dkdv_persistent_producer, (producer, work, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT,
                                             DYNAMIC)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_dkdv_persistent_consumer, (consumer, work, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT,
                                             ACCUMULATE, DQ_ATOMIC, 2, 0, DYNAMIC, SOFTCAP,
                                             DQ_ROWS)),
                (_dkdv_persistent_consumer, (consumer, work, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT,
                                             ACCUMULATE, DQ_ATOMIC, 2, 1, DYNAMIC, SOFTCAP,
                                             DQ_ROWS)),
                (_dkdv_persistent_producer, (producer, work, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT,
                                             DYNAMIC)),
            ],
            [NUM_WARPS, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# ----------------------------------------------------------------------------- dQ (deterministic)


@gluon.jit
def _dq_producer(args, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """TMA loads: Q and dO of each query tile, then K and V of every visible key tile."""
    (
        q_base, do_base, k_base, v_base, stride_qt, stride_dot, stride_kt, stride_vt, seqlen_q, seqlen_k,
        d_lo, d_hi, first, step, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, ready, empty,
    ) = args  # fmt: skip
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.shape[1]
    NUM_STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    smem: gl.constexpr = _SMEM_LAYOUT
    q_desc = row_descriptor(q_base, seqlen_q, HEAD_DIM, stride_qt, BLOCK_M, HEAD_DIM, smem)
    do_desc = row_descriptor(do_base, seqlen_q, HEAD_DIM, stride_dot, BLOCK_M, HEAD_DIM, smem)
    k_desc = row_descriptor(k_base, seqlen_k, HEAD_DIM, stride_kt, BLOCK_N, HEAD_DIM, smem)
    v_desc = row_descriptor(v_base, seqlen_k, HEAD_DIM, stride_vt, BLOCK_N, HEAD_DIM, smem)
    it = 0
    j = 0
    for m_block in range(first, gl.cdiv(seqlen_q, BLOCK_M), step):
        m0 = m_block * BLOCK_M
        mbarrier.wait(q_empty, (j & 1) ^ 1)
        mbarrier.expect(q_ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [m0, 0], q_ready, q_smem)
        tma_load(do_desc, [m0, 0], q_ready, do_smem)
        a, _, _, end = key_tiles(m0, seqlen_q, seqlen_k, d_lo, d_hi, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        for n0 in range(a, end, BLOCK_N):
            stage = it % NUM_STAGES
            mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma_load(k_desc, [n0, 0], bar, k_smem.index(stage))
            tma_load(v_desc, [n0, 0], bar, v_smem.index(stage))
            it += 1
        j += 1  # noqa: SIM113 -- no enumerate in a kernel


@gluon.jit
def _dq_consumer(
    args,
    HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    WG: gl.constexpr,
    SOFTCAP: gl.constexpr,
):
    """dQ of query rows ``[WG * WG_ROWS, (WG + 1) * WG_ROWS)`` of each query tile in registers
    (``WG_ROWS = BLOCK_M / NUM_CONSUMERS``), summed over key tiles in a fixed order. Tile shapes
    come from the shared-memory buffers, the warps from this partition."""
    (
        lse_base, delta_base, dq_base, stride_dqt, seqlen_q, seqlen_k, d_lo, d_hi, first, step, sm_scale,
        softcap, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, ready, empty,
    ) = args  # fmt: skip
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.shape[1]
    NUM_STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    WG_ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    dtype: gl.constexpr = k_smem.dtype
    if WG_ROWS == BLOCK_M:
        q_rows = q_smem
        do_rows = do_smem
    else:
        q_rows = q_smem.slice(WG * WG_ROWS, WG_ROWS)
        do_rows = do_smem.slice(WG * WG_ROWS, WG_ROWS)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    it = 0
    j = 0
    for m_block in range(first, gl.cdiv(seqlen_q, BLOCK_M), step):
        m0 = m_block * BLOCK_M
        own0 = m0 + WG * WG_ROWS
        rows_1d = own0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
        rows = gl.expand_dims(rows_1d, 1)
        lse = gl.load(lse_base + rows_1d, mask=rows_1d < seqlen_q, other=float("inf"))
        lse = gl.expand_dims(gl.where(lse == float("-inf"), float("inf"), lse) * LOG2E, 1)
        minus_delta = -gl.expand_dims(gl.load(delta_base + rows_1d, mask=rows_1d < seqlen_q, other=0.0), 1)
        a, b_, c, end = key_tiles(m0, seqlen_q, seqlen_k, d_lo, d_hi, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        dq = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, dq_layout)
        mbarrier.wait(q_ready, j & 1)
        for n0 in range(a, end, BLOCK_N):
            stage = it % NUM_STAGES
            dp_init = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout) + minus_delta
            mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
            k_tile = k_smem.index(stage)
            s_tok = warpgroup_mma(
                q_rows,
                k_tile.permute((1, 0)),
                gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout),
                use_acc=False,
                is_async=True,
            )
            dp_tok = warpgroup_mma(do_rows, v_smem.index(stage).permute((1, 0)), dp_init, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            s, t = scores_log2(s, sm_scale, softcap, SOFTCAP)
            p = gl.exp2(s - lse)
            if SOFTCAP:  # p only scales dS here: the tanh's derivative folded in
                p = p * (1.0 - t * t)
            if (n0 < b_) | (n0 >= c):
                cols = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
                p = gl.where(visible(rows, cols, seqlen_k, d_lo, d_hi, HAS_LEFT, HAS_RIGHT), p, 0.0)
            dp = warpgroup_mma_wait(0, deps=(dp_tok,))
            ds = gl.convert_layout((p * dp * sm_scale).to(dtype), a_layout)
            dq_tok = warpgroup_mma(ds, k_tile, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            cta_barrier()  # every warp of this partition is done with this stage
            mbarrier.arrive(empty.index(stage))
            it += 1
        cta_barrier()
        mbarrier.arrive(q_empty)
        j += 1  # noqa: SIM113 -- no enumerate in a kernel
        out_rows = gl.expand_dims(own0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, dq_layout)), 1)
        offs_d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout)), 0)
        mask = (out_rows < seqlen_q) & (offs_d < HEAD_DIM)
        dq_ptrs = dq_base + out_rows.to(gl.int64) * stride_dqt + offs_d
        if ACCUMULATE:  # add this launch's part to what the rows hold
            dq += gl.load(dq_ptrs, mask=mask, other=0.0).to(gl.float32)
        gl.store(dq_ptrs, dq.to(dq_base.dtype.element_ty), mask=mask)


@gluon.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr, cup_q_ptr, cup_k_ptr,
    pos_q_ptr, pos_k_ptr, rows_q, rows_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh, stride_lse_h, sm_scale, softcap, window_left,
    window_right, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HAS_POSITIONS: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ACCUMULATE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    head = gl.program_id(1)
    b = gl.program_id(2)
    num_seqs = gl.num_programs(2) - 1
    dq_head = dq_ptr + head * stride_dqh
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        _zero_padding(
            dq_head, stride_dqt, cu_q_ptr, cup_q_ptr, b, num_seqs, rows_q, HEAD_DIM, BLOCK_M,
            NUM_WARPS,
        )  # fmt: skip
    if b == num_seqs:
        return
    q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = sequence_pair(
        cu_q_ptr, cup_q_ptr, cu_k_ptr, cup_k_ptr, pos_q_ptr, pos_k_ptr, b, rows_q, rows_k, window_left,
        window_right, HAS_POSITIONS,
    )  # fmt: skip
    if gl.program_id(0) >= gl.cdiv(seqlen_q, BLOCK_M):  # no query tile of its own (as in _dkdv_kernel)
        return
    kv_head = head // GROUP
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    smem: gl.constexpr = _SMEM_LAYOUT
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], smem)
    q_ready, q_empty, ready, empty = _barriers(
        NUM_STAGES=NUM_STAGES, NUM_CONSUMERS=NUM_CONSUMERS, READY_ARRIVALS=1
    )
    q_base = q_ptr + q_start.to(gl.int64) * stride_qt + head * stride_qh
    do_base = do_ptr + q_start.to(gl.int64) * stride_dot + head * stride_doh
    k_base = k_ptr + k_start.to(gl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + k_start.to(gl.int64) * stride_vt + kv_head * stride_vh
    lse_base = lse_ptr + head * stride_lse_h + q_start
    delta_base = delta_ptr + head * stride_lse_h + q_start
    dq_base = dq_head + q_start.to(gl.int64) * stride_dqt
    first = gl.program_id(0)
    step = gl.num_programs(0)
    consumer = (
        lse_base, delta_base, dq_base, stride_dqt, seqlen_q, seqlen_k, d_lo, d_hi, first, step, sm_scale,
        softcap, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, ready, empty,
    )  # fmt: skip
    producer = (
        q_base, do_base, k_base, v_base, stride_qt, stride_dot, stride_kt, stride_vt, seqlen_q, seqlen_k,
        d_lo, d_hi, first, step, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, ready, empty,
    )  # fmt: skip
    if NUM_CONSUMERS == 1:
        gl.warp_specialize(
            [
                (_dq_consumer, (consumer, HAS_LEFT, HAS_RIGHT, ACCUMULATE, 1, 0, SOFTCAP)),
                (_dq_producer, (producer, HAS_LEFT, HAS_RIGHT)),
            ],
            [1],
            [PRODUCER_REGS],
        )
    else:  # two consumer warpgroups, each its half of the query tile, ordered only by the ring
        gl.warp_specialize(
            [
                (_dq_consumer, (consumer, HAS_LEFT, HAS_RIGHT, ACCUMULATE, 2, 0, SOFTCAP)),
                (_dq_consumer, (consumer, HAS_LEFT, HAS_RIGHT, ACCUMULATE, 2, 1, SOFTCAP)),
                (_dq_producer, (producer, HAS_LEFT, HAS_RIGHT)),
            ],
            [NUM_WARPS, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
