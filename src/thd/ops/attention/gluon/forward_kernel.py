"""Warp-specialized Gluon forward attention for Hopper (sm_90), FlashAttention-3's structure.

Persistent: ``G`` programs (one per SM) take the work items of a list built on the device from the
offsets (``schedule.py``: query tiles of ``BLOCK_M`` rows, tile index descending, heads in sections
innermost; ``work_order.py``), either every ``G``-th (``p, p + G, ...``, optionally every other
round reversed) or, with ``DYNAMIC``, the next unclaimed one from a ticket, so short documents leave
no empty programs and nothing syncs with the host.
Before the warp-specialized region the programs write every padding row (``out`` 0, ``lse`` -inf)
between them, as the ``tl`` kernel does; the cost is proportional to the padding. Then:

- the producer (one warp, 24 registers): per work item, device-side tensor descriptors bounded by
  the sequence's real rows (double-buffered with Q by item parity), a TMA load of Q, then the K and
  V tiles of every key tile the item sees into a ``STAGES``-deep shared-memory ring;
  ``k_full``/``v_full`` barriers carry the copies' byte counts; ``k_empty`` frees a stage's K once
  its ``Q K^T`` completed and ``v_empty`` its V once its ``P V`` did (FA3's separate K and V
  pipelines: the next K streams in while this tile's ``P V`` runs);
- the consumers (``NUM_WG = 2``: two 4-warp partitions of 240 registers, rows ``[0, 64)`` and
  ``[64, 128)`` of each tile; ``NUM_WG = 3``: three of 160 registers over 192-row tiles, FA3's
  head-dim-64 shape; ``NUM_WG = 1``: the default partition alone; Q arrives in one shared-memory
  buffer per consumer warpgroup): ``S = Q K^T`` by async
  ``wgmma`` from shared memory, the online softmax with ``exp2`` and the scale folded into one
  multiply-add, ``O += P V`` with P from registers. The next tile's ``Q K^T`` is issued with this
  tile's ``P V`` and waited for with one group in flight, so the softmax overlaps the ``P V``; the
  consumers take turns issuing their products (one ``turns`` mbarrier each, round robin, FA3's
  ping-pong), so one's softmax runs while another's products occupy the tensor cores.

The descriptors' shapes make the copy engine zero-fill rows past a sequence: padding or spare rows
never reach shared memory. Masks are applied only on tiles that cross a band edge or the sequence's
end; output rows are stored with a row mask. Visibility and tile ranges follow ``kernels.py``.
"""

from __future__ import annotations

from thd.ops.attention.geometry import padding_span, sequence_pair, visible
from thd.ops.attention.gluon import work_order
from thd.ops.attention.gluon.compat import (
    cta_barrier,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from thd.ops.attention.gluon.tiles import key_tiles
from thd.ops.attention.softmax_terms import fold_sink, tanh

__all__ = ["attention_fwd_kernel"]

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


# ----------------------------------------------------------------------------- sequence geometry


@gluon.jit
def _fill_padding(
    out_ptr, lse_ptr, stride_ot, stride_oh, stride_lse_h, cu_ptr, cup_ptr, num_seqs, num_heads, num_rows,
    WIDTH: gl.constexpr, SLOTS: gl.constexpr,
):  # fmt: skip
    """This program's share of every slot's padding rows (and the tail past the last slot):
    ``out`` 0 and ``lse`` -inf. Work is split over (slot, head, chunk of rows) round robin; without
    ``SLOTS`` (packed sequences) only the tail can hold padding, so only its jobs run."""
    BLOCK_R: gl.constexpr = 32
    CHUNKS: gl.constexpr = 4
    W: gl.constexpr = gl.num_warps()
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // WIDTH, WIDTH // 8], [W, 1], [1, 0])
    line: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    offs_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, tile))
    offs_w = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, tile))
    offs_l = gl.arange(0, BLOCK_R, layout=line)
    zeros = gl.zeros([BLOCK_R, WIDTH], out_ptr.dtype.element_ty, layout=tile)
    minus_inf = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=line)
    first_job = 0 if SLOTS else num_seqs * num_heads * CHUNKS
    for job in range(first_job + gl.program_id(0), (num_seqs + 1) * num_heads * CHUNKS, gl.num_programs(0)):
        chunk = job % CHUNKS
        head = (job // CHUNKS) % num_heads
        b = job // (CHUNKS * num_heads)
        lo, hi = padding_span(
            cu_ptr=cu_ptr, cup_ptr=cup_ptr, b=b, num_seqs=num_seqs, num_rows=num_rows, WIDE=True
        )
        out_head = out_ptr + head * stride_oh
        lse_head = lse_ptr + head * stride_lse_h
        for row0 in range(lo + chunk * BLOCK_R, hi, CHUNKS * BLOCK_R):
            rows = row0 + offs_r
            ptrs = out_head + gl.expand_dims(rows * stride_ot, 1) + gl.expand_dims(offs_w, 0)
            mask = gl.expand_dims(rows < hi, 1) & gl.expand_dims(offs_w < WIDTH, 0)
            gl.store(ptrs, zeros, mask=mask)
            rows_l = row0 + offs_l
            gl.store(lse_head + rows_l, minus_inf, mask=rows_l < hi)


@gluon.jit
def _work_item(
    w, work, HAS_POSITIONS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
):  # fmt: skip
    """Work item ``w`` (``work_order.item_and_head``) of the list and layout ``work`` (the kernel's
    tuple): its head, query tile, the sequence's query and key spans, its visible band
    ``[d_lo, d_hi]`` of key index minus query index (bottom-right aligned, or placed by the
    positions) and the query tile's key tiles ``(a, b, c, end)`` (``key_tiles``)."""
    (
        seq_ptr, blk_ptr, total, num_heads, head_section, serpentine, cu_q_ptr, cup_q_ptr, cu_k_ptr,
        cup_k_ptr, pos_q_ptr, pos_k_ptr, rows_q, rows_k, window_left, window_right,
    ) = work  # fmt: skip
    item, head = work_order.item_and_head(w, total, num_heads, head_section, serpentine)
    b = gl.load(seq_ptr + item)
    m_block = gl.load(blk_ptr + item)
    q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = sequence_pair(
        cu_q_ptr=cu_q_ptr, cup_q_ptr=cup_q_ptr, cu_k_ptr=cu_k_ptr, cup_k_ptr=cup_k_ptr, pos_q_ptr=pos_q_ptr,
        pos_k_ptr=pos_k_ptr, b=b, rows_q=rows_q, rows_k=rows_k, window_left=window_left,
        window_right=window_right, HAS_POSITIONS=HAS_POSITIONS, WIDE=True,
    )  # fmt: skip
    a, b, c, end = key_tiles(
        m0=m_block * BLOCK_M, seqlen_q=seqlen_q, seqlen_k=seqlen_k, d_lo=d_lo, d_hi=d_hi,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
    )  # fmt: skip
    return head, m_block, q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi, a, b, c, end


# ----------------------------------------------------------------------------- producer


@gluon.jit
def _head_rows(ptr, start, stride_t, head, stride_h, num_rows, BLOCK_R: gl.constexpr, WIDTH: gl.constexpr):
    """A TMA descriptor over head ``head``'s ``num_rows`` rows from row ``start`` of a ``[T, H, WIDTH]``
    tensor, read in ``[BLOCK_R, WIDTH]`` tiles: rows past them load as zeros and are never read."""
    return tma.make_tensor_descriptor(
        ptr + start * stride_t + head * stride_h,
        shape=[gl.maximum(num_rows, 1), WIDTH],
        strides=[stride_t, 1],
        block_shape=[BLOCK_R, WIDTH],
        layout=gl.NVMMASharedLayout.get_default_for([BLOCK_R, WIDTH], ptr.dtype.element_ty),
    )


@gluon.jit
def _load_item(
    item, kv_head, q_smem, first_part, q_full, ring, it, waited, PARTS: gl.constexpr, PACK: gl.constexpr,
    PROFILE: gl.constexpr,
):  # fmt: skip
    """One work item's copies: descriptors bounded by the sequence's real rows (rows past them read
    as zeros), Q into ``q_buf``, then the K and V tiles ``[a, end)`` into the ``ring`` of stages.
    With ``PACK = 2`` the item is two query heads ``head, head + 1`` (one K/V head) over half a
    tile of positions each: Q holds the first head's rows, then the second's.
    Tile shapes come from the shared-memory buffers."""
    (
        q_ptr, k_ptr, v_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        head, m_block, q_start, seqlen_q, k_start, seqlen_k, a, end,
    ) = item  # fmt: skip
    k_smem, v_smem, k_full, v_full, k_empty, v_empty = ring
    ROWS: gl.constexpr = q_smem.shape[1]  # Q in PARTS buffers of ROWS rows from first_part
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM_V: gl.constexpr = v_smem.shape[2]
    q_desc = _head_rows(
        ptr=q_ptr, start=q_start, stride_t=stride_qt, head=head, stride_h=stride_qh, num_rows=seqlen_q,
        BLOCK_R=ROWS // PACK, WIDTH=HEAD_DIM,
    )  # fmt: skip
    k_desc = _head_rows(
        ptr=k_ptr, start=k_start, stride_t=stride_kt, head=kv_head, stride_h=stride_kh, num_rows=seqlen_k,
        BLOCK_R=BLOCK_N, WIDTH=HEAD_DIM,
    )  # fmt: skip
    v_desc = _head_rows(
        ptr=v_ptr, start=k_start, stride_t=stride_vt, head=kv_head, stride_h=stride_vh, num_rows=seqlen_k,
        BLOCK_R=BLOCK_N, WIDTH=HEAD_DIM_V,
    )  # fmt: skip
    if PACK == 2:
        q_next = _head_rows(
            ptr=q_ptr, start=q_start, stride_t=stride_qt, head=head + 1, stride_h=stride_qh,
            num_rows=seqlen_q, BLOCK_R=ROWS // 2, WIDTH=HEAD_DIM,
        )  # fmt: skip
        HALF: gl.constexpr = ROWS // 2
        mbarrier.expect(q_full, 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [m_block * HALF, 0], q_full, q_smem.index(first_part).slice(0, HALF, dim=0))
        tma_load(q_next, [m_block * HALF, 0], q_full, q_smem.index(first_part).slice(HALF, HALF, dim=0))
    else:
        mbarrier.expect(q_full, PARTS * q_desc.block_type.nbytes)
        for part in gl.static_range(PARTS):
            tma_load(q_desc, [(m_block * PARTS + part) * ROWS, 0], q_full, q_smem.index(first_part + part))
    for kn in range(a, end, BLOCK_N):
        s = it % STAGES
        free = ((it // STAGES) & 1) ^ 1
        if PROFILE:
            c0 = _tick(it)
        mbarrier.wait(k_empty.index(s), free)
        if PROFILE:
            c1 = _tick(it)
        mbarrier.expect(k_full.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [kn, 0], k_full.index(s), k_smem.index(s))
        if PROFILE:
            c2 = _tick(it)
        mbarrier.wait(v_empty.index(s), free)
        if PROFILE:
            waited += ((c1 - c0) + (_tick(it) - c2)).to(gl.int32)
        mbarrier.expect(v_full.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [kn, 0], v_full.index(s), v_smem.index(s))
        it += 1
    return it, waited


@gluon.jit
def _producer(
    args, GROUP: gl.constexpr, HAS_POSITIONS: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    NUM_WG: gl.constexpr, PACK: gl.constexpr, PROFILE: gl.constexpr, DYNAMIC: gl.constexpr,
):  # fmt: skip
    """The copies of this program's work items, in the order the consumer reads them. With
    ``DYNAMIC`` the producer takes each next item from a global ticket (``ticket_ptr[0]``, one
    atomic add, fetched one item ahead) and publishes it to the consumers; when the tickets run
    out it publishes the end (the first consumer then counts the program done). Q and the
    descriptors are double-buffered by item parity: rewriting a buffer's descriptors waits for the
    consumer to release that buffer's Q, which it does once it has read every tile of that item.
    Tile shapes come from the shared-memory buffers."""
    (
        q_ptr, k_ptr, v_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        q_smem, k_smem, v_smem, q_bars, k_full, v_full, k_empty, v_empty, work, total, prof_ptr, items,
        item_bars, ticket_ptr,
    ) = args  # fmt: skip
    ring = (k_smem, v_smem, k_full, v_full, k_empty, v_empty)
    it = 0
    t = 0
    waited = 0
    if PROFILE:  # cycles: waiting for free K/V stages, item geometry, Q buffer waits, issuing copies
        start = _tick(t)
        waited = 0
        p_item = 0
        p_q = 0
        p_load = 0
    PARTS: gl.constexpr = 3 if NUM_WG == 3 else 1  # Q buffers per query tile (QUERY_PARTS)
    TILE_M: gl.constexpr = PARTS * q_smem.shape[1] // PACK  # positions per item
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    w = work_order.fetch_add(ticket_ptr, "relaxed") if DYNAMIC else gl.program_id(0)
    while w < total:
        if PROFILE:
            c0 = _tick(t)
        unit, m_block, q_start, seqlen_q, k_start, seqlen_k, _, _, a, _, _, end = _work_item(
            w, work, HAS_POSITIONS, TILE_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        head = unit * PACK
        qi = t & 1
        if PROFILE:
            c1 = _tick(end)
        mbarrier.wait(q_bars.index(2 + qi), ((t >> 1) & 1) ^ 1)
        if DYNAMIC:  # the slot is free with the Q buffer
            work_order.publish_item(items, item_bars, qi, w)
            w_next = work_order.fetch_add(ticket_ptr, "relaxed")
        else:
            w_next = w + gl.num_programs(0)
        if PROFILE:
            c2 = _tick(end)
            p_item += (c1 - c0).to(gl.int32)
            p_q += (c2 - c1).to(gl.int32)
        item = (
            q_ptr, k_ptr, v_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            head, m_block, q_start, seqlen_q, k_start, seqlen_k, a, end,
        )  # fmt: skip
        if qi == 0:  # two call sites: two descriptor sets in the global scratch
            it, waited = _load_item(
                item, head // GROUP, q_smem, 0, q_bars.index(0), ring, it, waited, PARTS, PACK, PROFILE
            )
        else:
            it, waited = _load_item(
                item, head // GROUP, q_smem, PARTS, q_bars.index(1), ring, it, waited, PARTS, PACK, PROFILE
            )
        if PROFILE:
            p_load += (_tick(it) - c2).to(gl.int32)
        t += 1
        w = w_next
    if DYNAMIC:  # the end (w >= total), once the consumers are done with the slot
        qi = t & 1
        mbarrier.wait(q_bars.index(2 + qi), ((t >> 1) & 1) ^ 1)
        work_order.publish_item(items, item_bars, qi, w)
    if PROFILE:  # row NUM_WG: total, geometry, Q buffer waits, copies, stage waits in them, tiles, items
        z = gl.to_tensor(0)
        total_cycles = (_tick(t) - start).to(gl.int32)
        _record(prof_ptr, NUM_WG, (total_cycles, p_item, p_q, p_load, waited, z + it, z + t))


# ----------------------------------------------------------------------------- consumer


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    kn,
    rows,
    seqlen_k,
    d_lo,
    d_hi,
    b_full,
    c_full,
    sm_scale,
    softcap,
    BLOCK_N: gl.constexpr,
    HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr,
    FOLD_SCALE: gl.constexpr,
):
    """Fold one tile of raw scores into the running ``(m_i, l_i)`` (log2 domain); returns the
    probabilities ``p`` (fp32), the new ``m_i``, ``l_i`` and the factor ``alpha`` of the old sums."""
    if FOLD_SCALE:
        scale = sm_scale * LOG2E
    else:
        if SOFTCAP:
            x = s * (sm_scale / softcap)
            s = tanh(x) * (softcap * LOG2E)
        else:
            s = s * (sm_scale * LOG2E)
        scale = 1.0
    if (kn < b_full) | (kn + BLOCK_N > c_full):  # a band edge or the sequence's end crosses the tile
        cols = kn + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        seen = visible(
            r=gl.expand_dims(rows, 1), c=gl.expand_dims(cols, 0), num_keys=seqlen_k, d_lo=d_lo, d_hi=d_hi,
            HAS_LO=HAS_LEFT, HAS_HI=HAS_RIGHT,
        )  # fmt: skip
        s = gl.where(seen, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s * scale - gl.expand_dims(m_safe, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _after_softmax(l_i):
    """``l_i`` unchanged (``l_i < 0`` never holds: a sum of non-negative terms, or NaN), passed
    through a read of ``%clock``. The ptxas of Triton 3.6 and 3.9 moves nothing across a clock read,
    so the ``P V`` wait after this stays after the softmax's ``exp2``; without it ptxas hoists the
    wait (and the V release) above the whole softmax. Anchored on ``l_i``, which needs every
    ``exp2`` of the tile (on ``alpha`` the read lands before them)."""
    t = gl.inline_asm_elementwise(
        "mov.u32 $0, %clock;\n mov.u32 $1, $0;", "=r,=r,r,r", [l_i], dtype=gl.int32, is_pure=False, pack=2
    )
    return gl.where(l_i < 0.0, t.to(gl.float32, bitcast=True), l_i)


@gluon.jit
def _tick(anchor):
    """``%clock64`` (a volatile read, ordered with the other volatile operations; ``anchor`` only
    gives it an operand). The wait profile's clock: ``PROFILE`` only."""
    return gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [anchor], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _record(prof_ptr, slot, counters):
    """Add a partition's counters (int32: one program's cycles) to row ``slot`` (16 int64 each) of
    the profile buffer: the sums over programs and launches would overflow int32."""
    for i in gl.static_range(len(counters)):
        gl.atomic_add(prof_ptr + slot * 16 + i, counters[i].to(gl.int64))


@gluon.jit
def _release(bar):
    """Arrive on ``bar`` once every warp of this partition got here (the arrive is one thread's)."""
    cta_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _turn(turns, WG: gl.constexpr, NUM_WG: gl.constexpr, k):
    """Ping-pong of the consumer warpgroups: wait until the previous one issued its matrix products
    (the ``k``-th turn of warpgroup ``WG``; warpgroup 0 goes first, then 1, ..., round robin), so
    one group's softmax runs while another's products occupy the tensor cores. Returns the next
    turn's ``k``."""
    FIRST: gl.constexpr = 1 if WG == 0 else 0  # warpgroup 0's first wait passes at once
    if NUM_WG > 1:
        mbarrier.wait(turns.index(WG), (k & 1) ^ FIRST)
    return k + 1


@gluon.jit
def _pass_turn(turns, WG: gl.constexpr, NUM_WG: gl.constexpr):
    NEXT: gl.constexpr = (WG + 1) % NUM_WG
    if NUM_WG > 1:
        mbarrier.arrive(turns.index(NEXT))


@gluon.jit
def _consumer(
    args, HAS_POSITIONS: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    FOLD_SCALE: gl.constexpr, HAS_SINKS: gl.constexpr, ACCUMULATE: gl.constexpr,
    WG: gl.constexpr, NUM_WG: gl.constexpr, PACK: gl.constexpr, PROFILE: gl.constexpr, DYNAMIC: gl.constexpr,
):  # fmt: skip
    """Rows ``[WG * ROWS, (WG + 1) * ROWS)`` of every query tile of ``BLOCK_M`` rows (``ROWS =
    BLOCK_M / NUM_WG``); with two consumer partitions both walk the same key tiles (the whole tile's
    span), release each stage's K and V once each (the empty barriers count two arrivals) and take
    turns issuing. Tile shapes come from the shared-memory buffers."""
    (
        q_smem, k_smem, v_smem, q_bars, k_full, v_full, k_empty, v_empty, turns, out_ptr, lse_ptr,
        sinks_ptr, stride_ot, stride_oh, stride_lse_h, work, total, sm_scale, softcap, prof_ptr, items,
        item_bars, ticket_ptr,
    ) = args  # fmt: skip
    PARTS: gl.constexpr = 3 if NUM_WG == 3 else 1  # Q buffers per query tile (QUERY_PARTS)
    BLOCK_M: gl.constexpr = PARTS * q_smem.shape[1]
    ROWS: gl.constexpr = BLOCK_M // NUM_WG
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM_V: gl.constexpr = v_smem.shape[2]
    W: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, HEAD_DIM_V, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    # The output through shared memory (this warpgroup's rows of the item's Q buffer, free once its
    # last product is done) into rows of 16-byte stores, where it fits there: Dv == D, and out in
    # Q's dtype (the ring's fp32 accumulation is not); else stored from the accumulator's layout.
    STAGE_OUT: gl.constexpr = (q_smem.shape[2] == HEAD_DIM_V) and (out_ptr.dtype.element_ty == dtype)
    ROW_THREADS: gl.constexpr = HEAD_DIM_V // 8  # 8 elements (16 bytes) per thread and store
    out_rows: gl.constexpr = gl.BlockedLayout([1, 8], [32 // ROW_THREADS, ROW_THREADS], [W, 1], [1, 0])
    it = 0
    t = 0
    k = 0
    TILE_M: gl.constexpr = BLOCK_M // PACK  # positions per item
    FIRST_ROW: gl.constexpr = 0 if PACK == 2 else WG * ROWS  # packed: each warpgroup its own head
    if PROFILE:  # cycles per place (see the _record call at the end)
        start = _tick(t)
        c_item = 0
        c_q = 0
        c_k = 0
        c_v = 0
        c_turn = 0
        c_s = 0
        c_pv = 0
        c_end = 0
    w = work_order.take_item(items, item_bars, t) if DYNAMIC else gl.program_id(0)
    while w < total:
        if PROFILE:
            e0 = _tick(t)
        unit, m_block, q_start, seqlen_q, _, seqlen_k, d_lo, d_hi, a, b_full, c_full, end = _work_item(
            w, work, HAS_POSITIONS, TILE_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        head = unit * PACK + (WG if PACK == 2 else 0)
        out_base = out_ptr + head * stride_oh + q_start * stride_ot
        lse_base = lse_ptr + head * stride_lse_h + q_start
        rows = m_block * TILE_M + FIRST_ROW + gl.arange(0, ROWS, layout=row_s)
        rows_o = m_block * TILE_M + FIRST_ROW + gl.arange(0, ROWS, layout=row_o)
        cols_o = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
        out_ptrs = out_base + gl.expand_dims(rows_o.to(gl.int64) * stride_ot, 1) + gl.expand_dims(cols_o, 0)
        out_mask = gl.expand_dims(rows_o < seqlen_q, 1) & gl.expand_dims(cols_o < HEAD_DIM_V, 0)
        if ACCUMULATE:
            # Resume from a normalised partial (out, lse): m = lse (log2 domain), l = 1, acc = out;
            # a row with lse = -inf has seen no key yet (l = 0, out is 0 there).
            lse_prev = gl.load(lse_base + rows, mask=rows < seqlen_q, other=float("-inf"))
            m_i = lse_prev * LOG2E
            l_i = gl.where(lse_prev == float("-inf"), 0.0, 1.0)
            acc = gl.load(out_ptrs, mask=out_mask, other=0.0).to(gl.float32)
        else:
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
            acc = gl.zeros([ROWS, HEAD_DIM_V], gl.float32, layout=o_layout)
        qi = t & 1
        if PARTS == 1:
            q_buf = q_smem.index(qi)
            if NUM_WG == 2:
                q_buf = q_buf.slice(WG * ROWS, ROWS, dim=0)
        else:  # this warpgroup's own buffer
            q_buf = q_smem.index(qi * PARTS + WG)
        if PROFILE:
            e1 = _tick(end)
            c_item += (e1 - e0).to(gl.int32)
        mbarrier.wait(q_bars.index(qi), (t >> 1) & 1)
        if PROFILE:
            c_q += (_tick(end) - e1).to(gl.int32)
        num_tiles = gl.cdiv(end - a, BLOCK_N)
        if num_tiles > 0:
            s_idx = it % STAGES
            phase = (it // STAGES) & 1
            if PROFILE:
                e2 = _tick(it)
            mbarrier.wait(k_full.index(s_idx), phase)
            if PROFILE:
                e3 = _tick(it)
                c_k += (e3 - e2).to(gl.int32)
            s = warpgroup_mma(
                q_buf, k_smem.index(s_idx).permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            s = warpgroup_mma_wait(0, deps=[s])
            if PROFILE:
                c_s += (_tick(it) - e3).to(gl.int32)
            _release(k_empty.index(s_idx))  # K is read: its stage may take the next K
            p, m_i, l_i, alpha = _softmax_step(
                s, m_i, l_i, a, rows, seqlen_k, d_lo, d_hi, b_full, c_full, sm_scale, softcap,
                BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE,
            )  # fmt: skip
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, num_tiles):
                kn = a + j * BLOCK_N
                n_idx = (it + 1) % STAGES
                n_phase = ((it + 1) // STAGES) & 1
                if PROFILE:
                    f0 = _tick(it)
                mbarrier.wait(k_full.index(n_idx), n_phase)
                if PROFILE:
                    f1 = _tick(it)
                mbarrier.wait(v_full.index(s_idx), phase)
                if PROFILE:
                    f2 = _tick(it)
                k = _turn(turns, WG, NUM_WG, k)
                if PROFILE:
                    f3 = _tick(k)
                    c_k += (f1 - f0).to(gl.int32)
                    c_v += (f2 - f1).to(gl.int32)
                    c_turn += (f3 - f2).to(gl.int32)
                s = warpgroup_mma(
                    q_buf, k_smem.index(n_idx).permute((1, 0)), zero_s, use_acc=False, is_async=True
                )
                acc = warpgroup_mma(p_op, v_smem.index(s_idx), acc, is_async=True)
                _pass_turn(turns, WG, NUM_WG)
                if PROFILE:
                    f4 = _tick(k)
                s = warpgroup_mma_wait(1, deps=[s])  # this tile's scores; P V still in flight
                if PROFILE:
                    c_s += (_tick(k) - f4).to(gl.int32)
                _release(k_empty.index(n_idx))  # K of tile j is read
                p, m_i, l_i, alpha = _softmax_step(
                    s, m_i, l_i, kn, rows, seqlen_k, d_lo, d_hi, b_full, c_full, sm_scale, softcap,
                    BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE,
                )  # fmt: skip
                # measured: +5 % at head dim 128; -9 % with three consumers
                if NUM_WG == 2:
                    l_i = _after_softmax(l_i)
                if PROFILE:
                    f5 = _tick(k)
                acc = warpgroup_mma_wait(0, deps=[acc])
                if PROFILE:
                    c_pv += (_tick(k) - f5).to(gl.int32)
                _release(v_empty.index(s_idx))
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                it += 1
                s_idx = n_idx
                phase = n_phase
            if PROFILE:
                g0 = _tick(it)
            mbarrier.wait(v_full.index(s_idx), phase)
            if PROFILE:
                g1 = _tick(it)
            k = _turn(turns, WG, NUM_WG, k)
            if PROFILE:
                g2 = _tick(k)
                c_v += (g1 - g0).to(gl.int32)
                c_turn += (g2 - g1).to(gl.int32)
            acc = warpgroup_mma(p_op, v_smem.index(s_idx), acc, is_async=True)
            _pass_turn(turns, WG, NUM_WG)
            if PROFILE:
                g3 = _tick(k)
            acc = warpgroup_mma_wait(0, deps=[acc])
            if PROFILE:
                c_pv += (_tick(k) - g3).to(gl.int32)
            _release(v_empty.index(s_idx))
            it += 1
        if not STAGE_OUT:
            _release(q_bars.index(2 + qi))
        t += 1
        if PROFILE:
            e4 = _tick(t)
        if HAS_SINKS:  # one extra denominator term exp(sink) with no value row
            m_i, l_i, alpha = fold_sink(m_i=m_i, l_i=l_i, sinks_ptr=sinks_ptr, head=head)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        has_keys = l_i != 0.0  # NaN rows stay NaN
        l_safe = gl.where(has_keys, l_i, 1.0)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
        lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        if STAGE_OUT:  # through this warpgroup's rows of the Q buffer, then rows of 16-byte stores
            cta_barrier()  # every warp's products are done with Q
            q_buf.store(out.to(dtype))
            cta_barrier()
            staged = q_buf.load(out_rows)
            _release(q_bars.index(2 + qi))
            rows_w = m_block * TILE_M + FIRST_ROW + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_rows))
            cols_w = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, out_rows))
            gl.store(
                out_base + gl.expand_dims(rows_w.to(gl.int64) * stride_ot, 1) + gl.expand_dims(cols_w, 0),
                staged,
                mask=gl.expand_dims(rows_w < seqlen_q, 1) & gl.expand_dims(cols_w < HEAD_DIM_V, 0),
            )
        else:
            gl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        gl.store(lse_base + rows, lse, mask=rows < seqlen_q)
        if PROFILE:
            c_end += (_tick(t) - e4).to(gl.int32)
        if DYNAMIC:
            w = work_order.take_item(items, item_bars, t)
        else:
            w += gl.num_programs(0)
    if DYNAMIC and WG == 0:  # this program's producer took its last ticket
        work_order.retire_program(ticket_ptr)
    if PROFILE:  # row WG: total, item geometry, Q, K, V, turn, S, P V waits, epilogue, tiles, items
        z = gl.to_tensor(0)
        total_cycles = (_tick(t) - start).to(gl.int32)
        counters = (total_cycles, c_item, c_q, c_k, c_v, c_turn, c_s, c_pv, c_end, z + it, z + t)
        _record(prof_ptr, WG, counters)


# ----------------------------------------------------------------------------- kernel


@gluon.jit
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, sinks_ptr,
    cu_q_ptr, cu_k_ptr, cup_q_ptr, cup_k_ptr, pos_q_ptr, pos_k_ptr, seq_ptr, blk_ptr, count_ptr,
    num_seqs, num_heads, rows_q, rows_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    sm_scale, softcap, window_left, window_right, head_section, serpentine, prof_ptr,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, HAS_POSITIONS: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr,
    ACCUMULATE: gl.constexpr, FOLD_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, NUM_WG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    SLOTS: gl.constexpr, PACK: gl.constexpr, DYNAMIC: gl.constexpr, PROFILE: gl.constexpr = False,
):  # fmt: skip
    """Persistent: program ``p`` of ``G`` takes work items ``p, p + G, ...`` of the device-built
    list (``schedule.build_work_list``: ``count[0]`` query tiles, times the heads), or with
    ``DYNAMIC`` the next unclaimed item whenever its producer is ready for one (the ticket
    ``count[1]``, which ``build_work_list`` zeroes and the launch leaves at zero)."""
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        _fill_padding(
            out_ptr, lse_ptr, stride_ot, stride_oh, stride_lse_h, cu_q_ptr, cup_q_ptr, num_seqs, num_heads,
            rows_q, HEAD_DIM_V, SLOTS,
        )  # fmt: skip
    units = num_heads // PACK  # an item's heads: one, or with PACK = 2 a pair sharing K/V (NUM_WG = 2)
    total = gl.load(count_ptr) * units

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Q of two query tiles (double-buffered by item parity): one buffer each, or with three
    # consumer warpgroups one per warpgroup (192 rows is no power of two; two buffers are spare)
    QUERY_PARTS: gl.constexpr = 3 if NUM_WG == 3 else 1
    Q_BUFFERS: gl.constexpr = 8 if NUM_WG == 3 else 2
    Q_ROWS: gl.constexpr = BLOCK_M // QUERY_PARTS
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_V], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS, Q_ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM_V], v_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # full 0, 1; empty 0, 1
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    # DYNAMIC: the producer's work items for the consumers, by item parity
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(item_bars.index(i), count=1)
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_bars.index(2 + i), count=NUM_WG)
    for i in gl.static_range(NUM_WG):
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    fence_async_shared()

    # In Triton 3.6 a tuple bound to a name inside the kernel turns its constexprs into values
    # ("Shape element 0 must have type constexpr[int]"): the tuples bound here hold values only, the
    # constexprs are spelled out in each entry.
    work = (  # the work list and the layout, as _work_item reads them
        seq_ptr, blk_ptr, total, units, head_section, serpentine, cu_q_ptr, cup_q_ptr, cu_k_ptr, cup_k_ptr,
        pos_q_ptr, pos_k_ptr, rows_q, rows_k, window_left, window_right,
    )  # fmt: skip
    consumer = (
        q_smem, k_smem, v_smem, q_bars, k_full, v_full, k_empty, v_empty, turns, out_ptr, lse_ptr,
        sinks_ptr, stride_ot, stride_oh, stride_lse_h, work, total, sm_scale, softcap, prof_ptr, items,
        item_bars, count_ptr + 1,
    )  # fmt: skip
    producer = (
        q_ptr, k_ptr, v_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        q_smem, k_smem, v_smem, q_bars, k_full, v_full, k_empty, v_empty, work, total, prof_ptr, items,
        item_bars, count_ptr + 1,
    )  # fmt: skip
    if NUM_WG == 3:  # three 4-warp consumer partitions taking turns, and the producer warp
        gl.warp_specialize(
            [
                (_consumer, (consumer, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE, HAS_SINKS,
                             ACCUMULATE, 0, 3, PACK, PROFILE, DYNAMIC)),
                (_consumer, (consumer, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE, HAS_SINKS,
                             ACCUMULATE, 1, 3, PACK, PROFILE, DYNAMIC)),
                (_consumer, (consumer, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE, HAS_SINKS,
                             ACCUMULATE, 2, 3, PACK, PROFILE, DYNAMIC)),
                (_producer, (producer, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, NUM_WG, PACK, PROFILE,
                             DYNAMIC)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    elif NUM_WG == 2:  # two 4-warp consumer partitions taking turns, and the producer warp
        gl.warp_specialize(
            [
                (_consumer, (consumer, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE, HAS_SINKS,
                             ACCUMULATE, 0, 2, PACK, PROFILE, DYNAMIC)),
                (_consumer, (consumer, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE, HAS_SINKS,
                             ACCUMULATE, 1, 2, PACK, PROFILE, DYNAMIC)),
                (_producer, (producer, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, NUM_WG, PACK, PROFILE,
                             DYNAMIC)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:  # one consumer partition of num_warps warps, and the producer warp
        gl.warp_specialize(
            [
                (_consumer, (consumer, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, SOFTCAP, FOLD_SCALE, HAS_SINKS,
                             ACCUMULATE, 0, 1, PACK, PROFILE, DYNAMIC)),
                (_producer, (producer, GROUP, HAS_POSITIONS, HAS_LEFT, HAS_RIGHT, NUM_WG, PACK, PROFILE,
                             DYNAMIC)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip
