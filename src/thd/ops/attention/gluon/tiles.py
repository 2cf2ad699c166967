"""Tile geometry shared by the Gluon kernels (``@gluon.jit`` helpers, inlined): which partner tiles
a tile of rows sees under the visibility band, which of them need a mask, the TMA descriptor over
one sequence's rows, and the persistent kernels' work order: static (:func:`item_and_head`) or
dynamic (a global ticket the producer draws from, :func:`fetch_add`, handing each item to the
consumers through a shared slot, :func:`publish_item` / :func:`take_item`, and the last program to
finish zeroing the ticket for the next launch, :func:`retire_program`).

Visibility: query ``i`` sees key ``j`` iff ``j - i`` lies in ``[d_lo, d_hi]``, a side bounded only
with ``HAS_LEFT`` / ``HAS_RIGHT`` (``geometry.tile_ranges``, shared with the ``tl`` kernels).
"""

from __future__ import annotations

from thd.ops.attention.geometry import tile_ranges
from thd.ops.attention.gluon.compat import cta_barrier, gl, gluon, mbarrier, tma

__all__ = [
    "fetch_add",
    "item_and_head",
    "key_tiles",
    "publish_item",
    "query_tiles",
    "retire_program",
    "row_descriptor",
    "take_item",
]


@gluon.jit
def query_tiles(
    n0, seqlen_k, seqlen_q, d_lo, d_hi,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
):  # fmt: skip
    """Query tiles of key tile ``[n0, n0 + BLOCK_N)``: ``(a, b, c, end)``; a partial key tile is
    masked everywhere. Query ``r`` sees key ``c`` iff ``r - c`` in ``[-d_hi, -d_lo]``."""
    last = gl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    a, b, c, end = tile_ranges(n0, last, -d_hi, -d_lo, seqlen_q, BLOCK_M, HAS_RIGHT, HAS_LEFT)
    if last < n0 + BLOCK_N - 1:
        b = a
        c = a
    return a, b, c, end


@gluon.jit
def key_tiles(
    m0, seqlen_q, seqlen_k, d_lo, d_hi,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
):  # fmt: skip
    """Key tiles of query tile ``[m0, m0 + BLOCK_M)``: ``(a, b, c, end)``; a partial query tile
    needs no mask of its own (its rows past the end have lse = +inf, so P = 0)."""
    last = gl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    return tile_ranges(m0, last, d_lo, d_hi, seqlen_k, BLOCK_N, HAS_LEFT, HAS_RIGHT)


@gluon.jit
def row_descriptor(
    base, num_rows, width, stride_t, BLOCK_R: gl.constexpr, BLOCK_W: gl.constexpr, layout: gl.constexpr
):
    """A TMA descriptor over the ``[num_rows, width]`` view at ``base`` read in
    ``[BLOCK_R, BLOCK_W]`` tiles: rows past ``num_rows`` load as zeros and are never read."""
    return tma.make_tensor_descriptor(
        base,
        shape=[gl.maximum(num_rows, 1), width],
        strides=[stride_t, 1],
        block_shape=[BLOCK_R, BLOCK_W],
        layout=layout,
    )


@gluon.jit
def item_and_head(w, total, num_heads, head_section, serpentine):
    """List item ``item`` (a query tile in the forward, a key tile in the persistent backward) and
    ``head`` of this program's work item ``w`` of ``total = tiles * num_heads``. Program ``p`` of
    ``G`` takes ``p, p + G, ...``; with ``serpentine`` every other full round of ``G`` is taken in
    reverse (program ``p`` gets ``G - 1 - p`` of it), so the program with a round's longest item
    gets the next round's shortest. The list: the heads in sections of ``head_section`` (a divisor
    of ``num_heads``), one section after another, each section's tiles longest first with its heads
    innermost. Fewer heads at a time means more programs on one head's data at once, so it stays in
    L2; ``head_section == num_heads`` is one section."""
    if serpentine:
        programs = gl.num_programs(0)
        lap = w // programs
        if ((lap & 1) == 1) & ((lap + 1) * programs <= total):
            w = (2 * lap + 1) * programs - 1 - w
    row = w // head_section  # section * tiles + item
    tiles = total // num_heads
    section = row // tiles
    return row - section * tiles, section * head_section + w - row * head_section


@gluon.jit
def fetch_add(ptr, SEM: gl.constexpr):
    """``ptr[0] += 1`` by the partition's first thread; every thread gets the old value (a scalar
    atomic would be every thread's, and ptxas merges a warp's into one add of 32)."""
    W: gl.constexpr = gl.num_warps()
    threads: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    offs = gl.arange(0, 32 * W, layout=threads)
    first = offs == 0
    old = gl.atomic_add(ptr + offs * 0, gl.full([32 * W], 1, gl.int32, threads), mask=first, sem=SEM)
    return gl.max(gl.where(first, old, -1), axis=0)


@gluon.jit
def publish_item(items, item_bars, slot, w):
    """The producer (one warp) hands work item ``w`` to the consumers through ``slot`` (item
    parity): every lane's store, then the slot's barrier."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(slot).store(gl.full([1], w, gl.int32, layout=one))
    cta_barrier()
    mbarrier.arrive(item_bars.index(slot))


@gluon.jit
def take_item(items, item_bars, t):
    """A consumer's ``t``-th work item, from the slot the producer published it in."""
    W: gl.constexpr = gl.num_warps()
    one: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    slot = t & 1
    mbarrier.wait(item_bars.index(slot), (t >> 1) & 1)
    return gl.sum(items.index(slot).load(one), axis=0)


@gluon.jit
def retire_program(ticket_ptr):
    """Once a program's producer has drawn its last ticket (``ticket_ptr[0]``): count the program
    done (``ticket_ptr[1]``); the last one counted zeroes both for the next launch (every ticket is
    drawn by then)."""
    if fetch_add(ticket_ptr + 1, "acq_rel") == gl.num_programs(0) - 1:
        gl.store(ticket_ptr, 0)
        gl.store(ticket_ptr + 1, 0)
