"""Host side of the Gluon sm_90 attention backward: which calls it covers, tiles, grids, buffers.

:func:`backward` keeps :func:`thd.ops.attention.launch.backward`'s contract exactly (one
:class:`~thd.ops.attention.params.BackwardCall`); calls that
:func:`supports_backward` turns down (CPU, the interpreter, GPUs other than sm_90, a Triton
without Gluon's Hopper surface, head dims other than 64 and 128, D != Dv, fp32,
tensors the copy engine cannot read) stay on the tl kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from thd._runtime.config import kernel_settings
from thd._runtime.launcher import ensure_scratch_allocator
from thd.errors import ThdValueError
from thd.ops.attention.buffers import delta_buffer, gradient_buffers
from thd.ops.attention.gluon import host
from thd.ops.attention.gluon.host import HEAD_DIMS, PlannedLaunch, PlanTable, WarpSpecializedTile, device_sms
from thd.ops.attention.gluon.work_lists import planned_work_list, work_list_launch
from thd.ops.attention.params import BackwardCall
from thd.ops.attention.plan_keys import inputs_key

__all__ = [
    "ATOMIC_DQ",
    "DYNAMIC_ORDER",
    "ONE_CONSUMER_TILES",
    "PERSISTENT",
    "PLANS",
    "TILES",
    "TWO_CONSUMER_TILES",
    "GluonTile",
    "backward",
    "dynamic",
    "persistent",
    "supports_backward",
    "tiles_for",
]

_SETTINGS = kernel_settings()  # read once, with the kernels (thd._runtime.config)


@dataclass(frozen=True)
class GluonTile(WarpSpecializedTile):
    """The backward's tile: rows per tile (``block_m`` queries, ``block_n`` keys), consumer
    partitions (1: one of 8 warps, i.e. two warpgroups running the same code; 2: two 4-warp
    partitions, each its half of the tile, ordered only by the ring's mbarriers) and TMA ring
    stages; the producer's and second consumer's registers as :class:`WarpSpecializedTile`'s."""

    consumers: int = 1
    num_stages: int = 2
    # Persistent dK/dV programs (one per SM) over a device-built list of (sequence, key tile, kv
    # head) items, longest first (``backward_kernel._dkdv_persistent_kernel``), the heads in sections
    # of ``head_section`` (0: all), taken from a global ticket with ``dynamic``, else in static
    # rounds, every other one reversed with ``serpentine`` (``work_order.item_and_head``): always with
    # ``persistent``, else where the call's ``max_seqlen_kv`` is at most ``persistent_up_to``;
    # elsewhere one program per key tile.
    persistent: bool = False
    persistent_up_to: int = 0
    # Sections of 4 heads: sections of 1 leave the static rounds uneven on long documents, one
    # section of all heads is slower on short ones (docs/gluon.md, "The persistent backward").
    head_section: int = 4
    serpentine: bool = True
    dynamic: bool = False
    # With two partitions and dQ added by the dK/dV kernel: each partition computes dQ of half the
    # query rows over every column (FA3's split at head dim 64), not every row over half the
    # columns; needs 128-query tiles (wgmma rows come in 64s). On at head dim 64 (TWO_CONSUMER_TILES).
    dq_rows: bool = False

    def __post_init__(self) -> None:
        if self.dq_rows and (self.consumers != 2 or self.block_m < 128):
            raise ThdValueError(
                f"GluonTile dq_rows: needs consumers=2 and block_m >= 128, got consumers={self.consumers}, "
                f"block_m={self.block_m}"
            )

    @property
    def num_warps(self) -> int:
        return 8 if self.consumers == 1 else 4

    def constexprs(self) -> dict[str, int]:
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "NUM_STAGES": self.num_stages,
            "NUM_WARPS": self.num_warps,
            "NUM_CONSUMERS": self.consumers,
            "CONSUMER_REGS": self.consumer_regs,
            "PRODUCER_REGS": self.producer_regs,
        }


# (kernel, head dim) -> tile. dK/dV: 128 keys (64 per consumer warpgroup) against 64-query tiles;
# dQ: 128 queries against 64-key tiles (128 at head dim 64).
ONE_CONSUMER_TILES: dict[tuple[str, int], GluonTile] = {
    ("dkdv", 64): GluonTile(block_m=64, block_n=128),
    ("dkdv", 128): GluonTile(block_m=64, block_n=128),
    ("dq", 64): GluonTile(block_m=128, block_n=64),
    ("dq", 128): GluonTile(block_m=128, block_n=64),
}
# The default: two 4-warp partitions (FA3's two consumer warpgroups). On the H200 (bf16, 16 heads,
# causal 32k of 512-8192, gluon-bwd-structures-6c44123.json) they took 5.24 / 3.43 ms against the
# one-partition tiles' 5.60 / 3.99 ms at head dim 128 / 64 (tl: 6.20 / 3.45). A three-stage dK/dV
# ring measured no faster with the split dQ (4.97 vs 4.97 ms, gluon-bwd-stats-smem-df281ed.json); with
# the atomic dQ (the default) it is (H100, alternating processes, gluon-bwd-tiles-ab-h100.json):
# 4.24-4.25 against 4.31-4.39 ms at head dim 128 (231 KB of shared memory; ptxas 3.6 spills 356
# bytes against 464). At head dim 64, 128-query tiles: 2.68-2.79 against 2.81-2.86 ms.
# ``THD_GLUON_BWD_CONSUMERS=1`` (read at import) selects the one-partition tiles. With the atomic
# dQ, two partitions add each dQ tile by a TMA reduce-add (FA3's), one partition (or a dq buffer
# TMA cannot address) by per-element atomics.
TWO_CONSUMER_TILES: dict[tuple[str, int], GluonTile] = {
    # persistent where the documents are short: gluon-bwd-persistent-sections-bf9bea9-h100.json
    # dQ by query rows: per-tile programs 2.687 -> 2.599 / 0.855 -> 0.834 / 0.458 -> 0.448 ms on 32k of
    # 512-8192 / 16k of 256-4096 / 16k of 64-1024, persistent ones level (3.273 -> 3.297 / 0.906 -> 0.902
    # / 0.439 -> 0.447; H100, one process, one round, gluon-bwd-dq-rows-881fcc3-h100.json)
    ("dkdv", 64): GluonTile(block_m=128, block_n=128, consumers=2, persistent_up_to=2048, dq_rows=True),
    ("dkdv", 128): GluonTile(block_m=64, block_n=128, consumers=2, num_stages=3),
    ("dq", 64): GluonTile(block_m=128, block_n=128, consumers=2),
    ("dq", 128): GluonTile(block_m=128, block_n=64, consumers=2),
}
TILES = dict(TWO_CONSUMER_TILES if _SETTINGS.gluon_bwd_consumers == 2 else ONE_CONSUMER_TILES)
# How the non-deterministic backward adds dQ: False its own kernel (as the deterministic backward
# does), True fp32 from the dK/dV kernel (a TMA reduce-add per tile with two partitions); None: per
# head dim, ATOMIC_DQ_BY_HEAD_DIM. Measured on the H200 in one run (bf16, 16 heads, causal 32k of
# 512-8192, gluon-bwd-stats-smem-df281ed.json, two partitions, lse and delta in shared memory):
# 4.50 ms atomic against 4.97 ms split at head dim 128, 2.93 against 3.29 ms at 64 (the kernels
# before df281ed, same machine, gluon-bwd-base-204b268.json: 5.20 / 5.05 and 3.02 / 3.43 ms).
# ``THD_GLUON_DQ_ATOMIC=0|1`` (read at import) fixes it.
ATOMIC_DQ: bool | None = _SETTINGS.gluon_dq_atomic
ATOMIC_DQ_BY_HEAD_DIM = {64: True, 128: True}
PERSISTENT: bool | None = None
"""Whether the dK/dV kernel runs persistent programs (:func:`persistent`). ``None``: the tile's.
Read when a plan is made."""
DYNAMIC_ORDER: bool | None = None
"""Whether persistent dK/dV programs take their items from a global ticket (:func:`dynamic`).
``None``: the tile's. Read when a plan is made."""
_PREPROCESS_ROWS = 64


def _tma_readable(t: Tensor) -> bool:
    """Rows of a ``[T, H, D]`` tensor the kernels' descriptors can read (or, for the fp32 dq, add
    tiles into by TMA): heads adjacent in a row
    (the dK/dV kernel addresses a head as a column offset of ``[T, H * D]``), 16-byte aligned
    base and row stride."""
    per_16_bytes = 16 // t.element_size()
    return (
        t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and t.stride(0) % per_16_bytes == 0
    )


def _readable_once_contiguous(t: Tensor) -> bool:
    """Whether :func:`_readable` gives the kernels rows they can read: ``t`` itself, or (a tensor
    whose last stride is not 1) its contiguous copy, judged from the shape alone: a fresh
    allocation is aligned, so only the row stride ``H * D`` must be a multiple of 16 bytes."""
    if t.stride(-1) == 1:
        return _tma_readable(t)
    return (t.shape[1] * t.shape[2] * t.element_size()) % 16 == 0


def supports_backward(call: BackwardCall) -> bool:
    """Whether :func:`backward` covers this call (metadata only: no device reads)."""
    q, k, v = call.saved[:3]
    accumulate = call.accumulate
    if not host.on_gluon_device(q) or not host.same_dtype(q, k, v):
        return False
    head_dim = q.shape[2]
    if head_dim not in HEAD_DIMS or k.shape[2] != head_dim or v.shape[2] != head_dim:
        return False
    if accumulate is not None and any(t.dtype != torch.float32 for t in accumulate):
        return False
    return all(_readable_once_contiguous(t) for t in (q, k, v))


def _cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _readable(t: Tensor) -> Tensor:
    return t if _tma_readable(t) else t.contiguous()


class _BackwardPlan(NamedTuple):
    """A backward's launches without the call's tensors (None: not launched), fixed by the plan's
    key (:func:`_plan_key`); ``tiles``: the table's entries it was made from (a changed table makes
    a new plan). ``work_list``: the persistent dK/dV kernel's list of key tiles (``capacity``
    items), None where one program per key tile runs."""

    tiles: tuple[GluonTile, GluonTile]
    preprocess: PlannedLaunch | None
    dkdv: PlannedLaunch | None
    dq: PlannedLaunch | None
    work_list: PlannedLaunch | None = None
    capacity: int = 0


PLANS = PlanTable()
"""The backward plans made so far."""


def _plan_key(call: BackwardCall, inputs: tuple, grads: tuple, atomic: bool) -> tuple:
    """What a plan depends on besides the tensors' identities: :func:`inputs_key` of the tensors the
    kernels read, the other tensors' strides, the dtype and device, sinks and accumulate given, how
    dQ is added, and whether TMA can add into ``dq``."""
    q, k, v, do, lse, _ = inputs
    out, sinks = call.saved.out, call.saved.sinks
    return inputs_key(call.layout, call.options, q, k, v) + (
        do.stride(),
        out.shape,
        out.stride(),
        lse.stride(),
        tuple(g.stride() for g in grads),
        q.dtype,
        q.device,
        sinks is None,
        call.accumulate is None,
        atomic,
        atomic and _tma_readable(grads[0]),
    )


def _make_plan(
    call: BackwardCall, inputs: tuple, grads: tuple, atomic: bool, tiles: tuple[GluonTile, GluonTile]
) -> _BackwardPlan:
    q, k, v, do, lse, delta = inputs
    dq, dk, dv = grads
    layout, options, sinks = call.layout, call.options, call.saved.sinks
    num_heads, num_kv_heads, num_seqs = q.shape[1], k.shape[1], layout.num_seqs
    max_q, max_kv = layout.max_seqlen_q, layout.max_seqlen_kv
    assert max_q is not None and max_kv is not None
    preprocess = None
    if num_seqs > 0 and max_q > 0 and q.shape[0] > 0:
        preprocess = PlannedLaunch(
            (_cdiv(max_q, _PREPROCESS_ROWS), num_heads, num_seqs),
            (q.shape[0], *host.row_strides(call.saved.out, do), delta.stride(0)),
            {
                "HEAD_DIM_V": v.shape[2],
                "HAS_SINKS": sinks is not None,
                "BLOCK_M": _PREPROCESS_ROWS,
                "NUM_WARPS": 4,
                "num_warps": 4,
            },
        )
    sizes = (q.shape[0], k.shape[0], *host.row_strides(q, k, v, do))
    softcap = options.softcap if options.softcap > 0.0 else 1.0  # SOFTCAP off: the value is unused
    window = (options.softmax_scale, softcap, max(options.window_left, 0), max(options.window_right, 0))
    variant = {
        "GROUP": num_heads // num_kv_heads,
        "HEAD_DIM": q.shape[2],
        "HAS_POSITIONS": layout.positions_q is not None and layout.positions_kv is not None,
        "HAS_LEFT": options.window_left >= 0,
        "HAS_RIGHT": options.window_right >= 0,
        "SOFTCAP": options.softcap > 0.0,
        "ACCUMULATE": call.accumulate is not None,
    }
    dkdv = work_list = None
    capacity = 0
    if k.shape[0] > 0:
        tile = tiles[0]
        if atomic and tile.consumers > 1 and not _tma_readable(dq):  # no TMA reduce-add: per-element atomics
            tile = replace(tile, consumers=1, dq_rows=False)
        keywords = {
            **variant,
            "DQ_ATOMIC": atomic,
            "DQ_ROWS": atomic and tile.consumers == 2 and tile.dq_rows,
            **tile.constexprs(),
            "num_warps": tile.num_warps,
        }
        tail = (*sizes, *host.row_strides(dk, dv, dq), lse.stride(0), *window)
        if persistent(tile, max_kv) and num_seqs > 0:
            rows_k = k.shape[0]
            capacity = rows_k // tile.block_n + num_seqs + 1  # bounds the key tiles of any valid layout
            work_list = work_list_launch(
                num_seqs=num_seqs, num_rows=rows_k, capacity=capacity, block_m=tile.block_n
            )
            section = host.section_size(num_kv_heads, tile.head_section)
            ticket = dynamic(tile)
            dkdv = PlannedLaunch(
                (min(device_sms(k), capacity * num_kv_heads),),
                (*tail, num_seqs, num_kv_heads, section, int(tile.serpentine and not ticket)),
                {**keywords, "SLOTS": layout.cu_seqlens_kv_padded is not None, "DYNAMIC": ticket},
            )
        else:
            dkdv = PlannedLaunch(
                (max(1, _cdiv(max_kv, tile.block_n)), num_kv_heads, num_seqs + 1), tail, keywords
            )
    dq_launch = None
    if not atomic and q.shape[0] > 0:
        tile = tiles[1]
        dq_launch = PlannedLaunch(
            (max(1, _cdiv(max_q, tile.block_m)), num_heads, num_seqs + 1),
            (*sizes, *host.row_strides(dq), lse.stride(0), *window),
            {**variant, **tile.constexprs(), "num_warps": tile.num_warps},
        )
    return _BackwardPlan(tiles, preprocess, dkdv, dq_launch, work_list, capacity)


def persistent(tile: GluonTile, max_seqlen_kv: int) -> bool:
    """Whether the dK/dV kernel runs persistent programs: :data:`PERSISTENT` where set, else the
    tile's choice for a call whose longest key sequence has ``max_seqlen_kv`` rows."""
    if PERSISTENT is not None:
        return PERSISTENT
    return tile.persistent or max_seqlen_kv <= tile.persistent_up_to


def dynamic(tile: GluonTile) -> bool:
    """Whether persistent dK/dV programs take their items from a global ticket:
    :data:`DYNAMIC_ORDER` where set, else the tile's."""
    return tile.dynamic if DYNAMIC_ORDER is None else DYNAMIC_ORDER


_SOFTCAP_DKDV_TILES: dict[GluonTile, GluonTile] = {}


def tiles_for(head_dim: int, softcap: bool) -> tuple[GluonTile, GluonTile]:
    """The (dK/dV, dQ) tiles of :data:`TILES` for a call, the same objects call after call. With
    ``softcap`` a two-partition dK/dV tile takes at most 64 queries: the tanh's values beside
    ``S^T``, ``dP^T``, dK and dV outgrow the consumers' registers with 128 (ptxas 3.6 at head dim
    64 spills 2856 bytes with 128, 44 with 64)."""
    dkdv = TILES[("dkdv", head_dim)]
    if softcap and dkdv.consumers == 2 and dkdv.block_m > 64:
        dkdv = _SOFTCAP_DKDV_TILES.setdefault(dkdv, replace(dkdv, block_m=64, dq_rows=False))
    return dkdv, TILES[("dq", head_dim)]


def _plan(call: BackwardCall, inputs: tuple, grads: tuple, atomic: bool) -> tuple[_BackwardPlan, bool]:
    """The call's plan, and whether an earlier call made it (else it is made now)."""
    tiles = tiles_for(inputs[0].shape[2], softcap=call.options.softcap > 0.0)
    key = _plan_key(call, inputs, grads, atomic)
    found = PLANS.get(key)
    if found is not None and found.tiles[0] is tiles[0] and found.tiles[1] is tiles[1]:
        return found, True
    plan = _make_plan(call, inputs, grads, atomic, tiles)
    PLANS.keep(key, plan, call.options)
    return plan, False


def backward(call: BackwardCall) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dsinks)`` as :func:`thd.ops.attention.launch.backward` returns them: padding
    rows 0; dQ from its own (bitwise-reproducible) kernel, or added in fp32 by the dK/dV kernel as
    :data:`ATOMIC_DQ` says, unless ``options.deterministic`` (or ``torch.use_deterministic_algorithms``);
    ``accumulate=(dq, dk, dv)`` (fp32) adds this launch's gradients on its real rows only. Launches
    from a cached plan (:func:`_plan`)."""
    from thd.ops.attention.gluon import backward_kernel as kernels

    do, (q, k, v, out, lse, sinks), layout, options, accumulate, _ = call
    q, k, v, do = (_readable(t) for t in (q, k, v, do))
    out = out if out.stride(-1) == 1 else out.contiguous()
    lse = lse.contiguous()
    if out is not call.saved.out:
        call = call._replace(saved=call.saved._replace(out=out))
    deterministic = options.deterministic or torch.are_deterministic_algorithms_enabled()
    head_dim = q.shape[2]
    atomic = (ATOMIC_DQ_BY_HEAD_DIM[head_dim] if ATOMIC_DQ is None else ATOMIC_DQ) and not deterministic
    grads = gradient_buffers(call, atomic_dq=atomic)
    dq, dk, dv = grads
    delta, shared_delta = delta_buffer(call, lse)
    dsink_rows = torch.zeros_like(lse) if sinks is not None else None
    inputs = (q, k, v, do, lse, delta)  # the leading arguments of both kernels
    plan, reused = _plan(call, inputs, grads, atomic)
    if plan.preprocess is not None and not shared_delta:
        row_terms = (q if sinks is None else sinks, delta if dsink_rows is None else dsink_rows)
        head = (out, do, delta, lse, *row_terms, layout.cu_seqlens_q, layout.slots_q)
        plan.preprocess.run(kernels._preprocess_kernel, head, reused)
    ensure_scratch_allocator()
    _, layout_args = host.sequence_args(layout)
    if plan.dkdv is not None and plan.work_list is None:
        plan.dkdv.run(kernels._dkdv_kernel, (*inputs, dk, dv, dq, *layout_args), reused)
    elif plan.dkdv is not None:  # persistent programs over the key tiles
        work = planned_work_list(layout.cu_seqlens_kv, layout.slots_kv, plan.work_list, plan.capacity, reused)
        plan.dkdv.run(kernels._dkdv_persistent_kernel, (*inputs, dk, dv, dq, *layout_args, *work), reused)
    if atomic:
        dq = dq if accumulate is not None else dq.to(q.dtype)
    elif plan.dq is not None:
        plan.dq.run(kernels._dq_kernel, (*inputs, dq, *layout_args), reused)
    dsinks = None if dsink_rows is None else dsink_rows.sum(1).to(sinks.dtype)  # type: ignore[union-attr]
    return dq, dk, dv, dsinks
