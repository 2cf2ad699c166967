"""Host side of the Gluon forward: which calls it takes (:func:`supports_forward`) and the launch
(:func:`forward`, the contract of ``thd.ops.attention.launch.forward``); both take one
:class:`~thd.ops.attention.params.ForwardCall`.

The kernel (``forward_kernel.py``) needs an sm_90 GPU, 16-bit inputs, head dims 64, 128 or 256 and rows
whose starts the copy engine can address (16-byte aligned data and row/head strides). Anything else
is for the ``tl`` kernels; the caller asks :func:`supports_forward` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from thd._runtime.launcher import ensure_scratch_allocator
from thd.ops.attention.buffers import forward_outputs
from thd.ops.attention.gluon.host import (
    PlannedLaunch,
    PlanTable,
    WarpSpecializedTile,
    device_index,
    num_sms,
    on_gluon_device,
    row_strides,
    same_dtype,
    section_size,
    sequence_args,
)
from thd.ops.attention.gluon.work_lists import WorkList, planned_work_list, work_list_launch
from thd.ops.attention.params import ForwardCall, VarlenLayout
from thd.ops.attention.plan_keys import inputs_key

__all__ = [
    "PLANS",
    "head_section",
    "packed_heads",
    "work_order",
    "GluonTile",
    "TILES",
    "forward",
    "supports_forward",
    "tile_for",
]


@dataclass(frozen=True)
class GluonTile(WarpSpecializedTile):
    """The forward's tile: query rows per work item (``block_m``, split over the consumer
    warpgroups), key rows per stage (``block_n``), warps of the default partition, the K/V ring's
    depth, the consumer partitions (2 or 3: 4-warp warpgroups of ``block_m / consumers`` rows taking
    turns, FA3's ping-pong, 3 with ``maxnreg=128, consumer_regs=160`` as FA3's 192-row head-dim-64
    tile; 1: the default partition alone), the kernel's per-thread register cap (the
    default partition gets the rest) and how many persistent programs share an SM; the producer's
    and second consumer's registers as :class:`WarpSpecializedTile`'s."""

    num_warps: int
    stages: int
    consumers: int = 2
    maxnreg: int = 168
    # Persistent programs per SM (shared memory and registers must allow it). Not used by TILES: on
    # the H200, 64x64w4s2c1 at maxnreg 128 with 2 per SM ran (D=128, slower than TILES), but the
    # D=64 tile 64x64w4s3c1 so configured raised "CUDA error: an illegal instruction" (not investigated).
    ctas_per_sm: int = 1
    # The work order (``work_order.item_and_head``): heads per section of the list (0: all),
    # items taken dynamically from a ticket, or else in static rounds, every other one reversed.
    head_section: int = 0
    dynamic: bool = False
    serpentine: bool = False
    sequence_major: bool = False  # the list's order (:data:`SEQUENCE_MAJOR`)

    @property
    def name(self) -> str:
        text = f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.stages}c{self.consumers}"
        if self.maxnreg != 168 or self.ctas_per_sm != 1:
            text += f"r{self.maxnreg}p{self.ctas_per_sm}"
        return text


# max(D, Dv) -> tile. Head dim 128: two consumer warpgroups of 64 rows each, FA3's 240/24 register
# split. Head dim 64: three of 64 rows at 160 registers (FA3's 192-row tile): 399 / 318 / 144 TFLOP/s
# against two's 374 / 305 / 123 on 32k of 512-8192 / 16k of 256-4096 / 16k of 64-1024 tokens
# (gluon-fwd-consumers-53cfff1.json, H200; the tl forward there: 406 / 348 / 207).
# Head dim 256: two consumer warpgroups of 64 rows over key tiles of 32 rows, two stages (ptxas of
# Triton 3.6: 197 KB of shared memory, no spills; 64-row key tiles need 257 KB and spill 88 bytes;
# three stages of 32 rows fit in 225 KB). 0.96-0.99x the tl forward on an H100
# (gluon-d256-8871d33-h100.json), so ``auto`` keeps tl there.
# The work order (gluon-fwd-dynamic-ab-h100.json, H100, against the static order of every head at
# once): head dim 128, dynamic with one head per section: 1.133 / 1.224 / 1.199 / 1.253x on 16k of
# 256-4096 / 16k of 64-1024 / 32k of 512-8192 / 64k of two 25k-40k documents; head dim 64,
# serpentine: 1.049x on 32k of 512-8192 (dynamic: 1.042x, and its consumers spill at 160 registers).
TILES: dict[int, GluonTile] = {
    64: GluonTile(192, 128, 4, 3, consumers=3, maxnreg=128, consumer_regs=160, serpentine=True),
    128: GluonTile(128, 128, 4, 2, head_section=1, dynamic=True),
    256: GluonTile(128, 32, 4, 2, head_section=1, dynamic=True),
}
FORWARD_HEAD_DIMS = tuple(TILES)
"""Head dims (``q``/``k`` and ``v`` each) the forward takes; the backward takes fewer
(:data:`thd.ops.attention.gluon.host.HEAD_DIMS`)."""


def tile_for(head_dim: int, head_dim_v: int) -> GluonTile:
    return TILES[max(head_dim, head_dim_v)]


def _copyable(t: Tensor) -> bool:
    """Whether TMA can read ``[T, H, D]`` rows of ``t`` per head: unit last stride, 16-byte
    aligned data, row and head strides."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * size) % 16 == 0
        and (t.stride(1) * size) % 16 == 0
    )


def supports_forward(call: ForwardCall) -> bool:
    """Whether :func:`forward` computes this call (else it is the ``tl`` kernels'): an sm_90 GPU,
    a Triton with Gluon's Hopper surface, bf16/fp16 ``q, k, v`` of one dtype, head dims 64, 128 or 256,
    TMA-addressable rows. ``options`` and ``sinks`` take any value the
    ``tl`` forward takes (every window, softcap, sink and scale is covered)."""
    q, k, v, accumulate = call.q, call.k, call.v, call.accumulate
    if not on_gluon_device(q) or not same_dtype(q, k, v):
        return False
    dims = FORWARD_HEAD_DIMS
    if q.shape[2] not in dims or k.shape[2] != q.shape[2] or v.shape[2] not in dims:
        return False
    if accumulate is not None and accumulate[1].stride(1) != 1:
        return False
    return all(_copyable(t) for t in (q, k, v))


class _ForwardPlan(NamedTuple):
    """Everything of a forward's two launches but the call's tensors, fixed by the plan's key
    (:func:`_plan_key`): the work list's capacity and launch and the kernel's; ``tile`` is the
    table's entry the plan was made from (a changed table makes a new plan)."""

    tile: GluonTile
    capacity: int
    work_list: PlannedLaunch
    attention: PlannedLaunch


PLANS = PlanTable()
"""The forward plans made so far."""


def _plan_key(call: ForwardCall, out: Tensor, lse: Tensor) -> tuple:
    """What a plan depends on besides the tensors' identities: :func:`inputs_key`, the outputs'
    strides, the dtype and device, and whether sinks and an accumulator are given."""
    q, k, v, layout, options, sinks, accumulate = call
    return inputs_key(layout, options, q, k, v) + (
        out.stride(),
        lse.stride(),
        q.dtype,
        q.device,
        sinks is None,
        accumulate is None,
    )


def packed_heads(call: ForwardCall, tile: GluonTile) -> int:
    """Query heads per work item: 2 (GQA row packing: each consumer warpgroup one head of a pair
    sharing K/V, over half a tile of positions) when the tile has two consumer warpgroups, the
    group is even, the head dims are at most 128 (packing is not built or tested with the
    head-dim-256 tile) and no query sequence is longer than half a tile (``max_seqlen_q``, a host
    value): one item then fills the tile two half-empty items would take; else 1."""
    longest = call.layout.max_seqlen_q
    group = call.q.shape[1] // call.k.shape[1]
    short = longest is not None and longest <= tile.block_m // 2
    narrow = max(call.q.shape[2], call.v.shape[2]) <= 128
    return 2 if tile.consumers == 2 and group % 2 == 0 and short and narrow else 1


def head_section(units: int, tile: GluonTile) -> int:
    """Heads per work-list section for ``units`` heads (or head pairs) per item: the largest divisor
    of ``units`` up to :data:`HEAD_SECTION` (or the tile's ``head_section`` where that is ``None``);
    ``units`` (one section) where the setting is 0."""
    return section_size(units, tile.head_section if HEAD_SECTION is None else HEAD_SECTION)


def work_order(tile: GluonTile) -> tuple[bool, bool]:
    """``(dynamic, serpentine)``: :data:`DYNAMIC_ORDER` and :data:`SERPENTINE` where set, else the
    tile's; serpentine rounds only in the static order."""
    dynamic = tile.dynamic if DYNAMIC_ORDER is None else DYNAMIC_ORDER
    serpentine = tile.serpentine if SERPENTINE is None else SERPENTINE
    return dynamic, serpentine and not dynamic


def _make_plan(call: ForwardCall, out: Tensor, lse: Tensor, tile: GluonTile) -> _ForwardPlan:
    q, k, v, layout, options, sinks, accumulate = call
    num_rows, num_heads, num_seqs = q.shape[0], q.shape[1], layout.num_seqs
    pack = packed_heads(call, tile)
    tile_m = tile.block_m // pack  # positions per work item
    # the work list's capacity bounds the query tiles of any valid layout: rows / tile_m + sequences
    capacity = num_rows // tile_m + num_seqs + 1
    sequence_major = tile.sequence_major if SEQUENCE_MAJOR is None else SEQUENCE_MAJOR
    work_list = work_list_launch(
        num_seqs=num_seqs, num_rows=num_rows, capacity=capacity, block_m=tile_m, sequence_major=sequence_major
    )
    grid = (min(num_sms(device_index(q.device)) * tile.ctas_per_sm, capacity * (num_heads // pack)),)
    dynamic, serpentine = work_order(tile)
    tail = (
        num_seqs,
        num_heads,
        num_rows,
        k.shape[0],
        *row_strides(q, k, v, out),
        lse.stride(0),
        options.softmax_scale,
        options.softcap if options.softcap > 0.0 else 1.0,
        max(options.window_left, 0),
        max(options.window_right, 0),
        head_section(num_heads // pack, tile),
        int(serpentine),
        None,  # prof_ptr: positional like every plain parameter, so the cached launcher takes the launch
    )
    keywords = {
        "GROUP": num_heads // k.shape[1],
        "HEAD_DIM": q.shape[2],
        "HEAD_DIM_V": v.shape[2],
        "HAS_POSITIONS": layout.positions_q is not None and layout.positions_kv is not None,
        "HAS_LEFT": options.window_left >= 0,
        "HAS_RIGHT": options.window_right >= 0,
        "SOFTCAP": options.softcap > 0.0,
        "HAS_SINKS": sinks is not None,
        "ACCUMULATE": accumulate is not None,
        "FOLD_SCALE": options.softmax_scale > 0.0 and options.softcap <= 0.0,
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "STAGES": tile.stages,
        "PRODUCER_REGS": max(tile.producer_regs, 32) if pack == 2 else tile.producer_regs,  # 24: spills
        "NUM_WG": tile.consumers,
        "CONSUMER_REGS": tile.consumer_regs,
        "SLOTS": layout.cu_seqlens_q_padded is not None,
        "num_warps": tile.num_warps,
        "PACK": pack,
        "DYNAMIC": dynamic,
        "PROFILE": False,
        "maxnreg": tile.maxnreg,
    }
    return _ForwardPlan(tile, capacity, work_list, PlannedLaunch(grid, tail, keywords))


def _plan(call: ForwardCall, out: Tensor, lse: Tensor) -> tuple[_ForwardPlan, bool]:
    """The call's plan, and whether an earlier call made it (else it is made now)."""
    tile = tile_for(call.q.shape[2], call.v.shape[2])
    key = _plan_key(call, out, lse)
    found = PLANS.get(key)
    if found is not None and found.tile is tile:
        return found, True
    plan = _make_plan(call, out, lse, tile)
    PLANS.keep(key, plan, call.options)
    return plan, False


def _work_list(layout: VarlenLayout, plan: _ForwardPlan, reused: bool) -> WorkList:
    """``(seq, blk, count)`` of the query tiles (:func:`.work_lists.planned_work_list`)."""
    return planned_work_list(layout.cu_seqlens_q, layout.slots_q, plan.work_list, plan.capacity, reused)


def forward(call: ForwardCall) -> tuple[Tensor, Tensor]:
    """One launch: ``(out, lse)``, padding rows written as 0 / -inf by the kernel.

    ``layout.max_seqlen_*`` are not needed (the work list is built on the device from the offsets,
    so there is no host sync either way). ``accumulate=(out, lse)``: fold this launch into that
    normalised partial result in place (only its real rows are read and written) and return it.
    """
    from thd.ops.attention.gluon.forward_kernel import attention_fwd_kernel

    q, k, v, layout, _, sinks, accumulate = call
    out, lse = forward_outputs(call)
    if q.shape[0] == 0:
        return out, lse
    if layout.num_seqs == 0:  # every row is tail capacity
        if accumulate is None:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    ensure_scratch_allocator()
    plan, reused = _plan(call, out, lse)
    seq, blk, count = _work_list(layout, plan, reused)
    _, layout_args = sequence_args(layout)
    head = (q, k, v, out, lse, q if sinks is None else sinks, *layout_args, seq, blk, count)
    if WAIT_PROFILE is not None:  # the wait profile (benchmarks/device/profile_gluon_waits.py)
        launch = plan.attention
        keywords = {**launch.keywords, "PROFILE": True}
        keywords["PRODUCER_REGS"] = max(keywords["PRODUCER_REGS"], 32)
        tail = (*launch.tail[:-1], WAIT_PROFILE)  # the tail ends with prof_ptr (_make_plan)
        attention_fwd_kernel[launch.grid](*head, *tail, **keywords)
        return out, lse
    plan.attention.run(attention_fwd_kernel, head, reused)
    return out, lse


HEAD_SECTION: int | None = None
"""Heads per section of the work list (``work_order.item_and_head``): the programs running at
one time share the K/V of fewer heads. ``None``: the tile's ``head_section``; 0: one section of
every head. Read when a plan is made (as are the two settings below)."""

DYNAMIC_ORDER: bool | None = None
"""Whether each program's producer takes the next unclaimed work item from a global ticket (one
atomic add per item) instead of every ``G``-th item, so the list's order, longest first, holds
across programs however long their items take. ``None``: the tile's ``dynamic``."""

SERPENTINE: bool | None = None
"""Whether every other full round of the static order is taken in reverse. ``None``: the tile's."""

SEQUENCE_MAJOR: bool | None = None
"""Whether the work list holds one sequence's query tiles after another (each from the longest
down) instead of every sequence's longest tiles first (``schedule.build_work_list``): the
programs running at once then read one long document's keys, not two or three documents'. Built
for the 64k row of two 25k-40k documents; slower or level on every row measured (H100,
gluon-fwd-sequence-major-881fcc3-h100.json), so off in every tile. ``None``: the tile's
``sequence_major``."""

WAIT_PROFILE: Tensor | None = None
"""An int64 buffer of ``(consumers + 1) x 16`` cycle counters: while set, every forward launch adds
its consumer warpgroups' (rows ``0 .. consumers - 1``) and producer's (row ``consumers``) wait
cycles to it (``forward_kernel``'s ``PROFILE``)."""
