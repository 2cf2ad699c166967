"""Tile geometry shared by the Gluon kernels (``@gluon.jit`` helpers, inlined): which partner tiles
a tile of rows sees under the visibility band, which of them need a mask, and the TMA descriptor
over one sequence's rows.

Visibility: query ``i`` sees key ``j`` iff ``j - i`` lies in ``[d_lo, d_hi]``, a side bounded only
with ``HAS_LEFT`` / ``HAS_RIGHT`` (``geometry.tile_ranges``, shared with the ``tl`` kernels).
"""

from __future__ import annotations

from thd.ops.attention.geometry import tile_ranges
from thd.ops.attention.gluon.compat import gl, gluon, tma

__all__ = ["key_tiles", "query_tiles", "row_descriptor"]


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
