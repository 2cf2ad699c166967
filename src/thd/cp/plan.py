"""Pure planning of the ring: which attention launches rank ``r`` runs at each step.

:func:`build_plan` turns one call's global layout and options (a :class:`PlanRequest`) into a
:class:`RingPlan`: per K/V block ``j`` the :class:`Launch` es (layout, causal flag, sinks) of
that step, plus this rank's local tables for the padding cleanup. Everything is device-side
index math on the ``cu_seqlens`` tensors (one :func:`thd.ops.ring_plan.ring_plan_tables` launch
per side, no sync), except the optional survey of a windowed call (one device-to-host read,
only with ``read_layout``). Nothing here communicates: plans are built and tested without
process groups (:mod:`thd.cp.ring` runs them, :mod:`thd.cp.reference` simulates them).

Schedules (rank ``r`` of ``cp``; its local slot holds chunks ``r`` and ``2cp-1-r``):

- plain, causal: ``j == r`` one causal launch over the local slots; ``j < r`` all local queries
  against the first half of K/V ``j``; ``j > r`` the second half of the queries against all of it;
- plain, not causal: one full launch per step;
- windowed (``window_size`` bounds a side, cp > 1): one launch per (query half, key half) pair
  that some query's window may reach, placed on the sequence's position axis by
  ``positions_q/kv`` (chunk index times chunk length); the others are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from thd.errors import ThdValueError
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["Launch", "PlanRequest", "RingPlan", "build_plan", "chunk_positions", "structural_pairs", "survey"]

_CAUSAL: dict[AttentionOptions, AttentionOptions] = {}  # base options -> with the other causal flag


@dataclass(frozen=True)
class Launch:
    """One attention kernel call of a ring step: its layout, whether it is causal, and whether
    it carries the sink term (forward) and returns ``dsinks`` (backward)."""

    layout: VarlenLayout
    causal: bool
    sinks: bool = False

    def launch_options(self, base: AttentionOptions) -> AttentionOptions:
        """``base`` (the plan's options) with this launch's causal flag."""
        if base.causal == self.causal:
            return base
        options = _CAUSAL.get(base)  # by value: calls with the same options share one entry
        if options is None:
            if len(_CAUSAL) >= 64:
                _CAUSAL.clear()
            options = _CAUSAL[base] = replace(base, causal=self.causal)
        return options


@dataclass(frozen=True)
class RingPlan:
    """Everything a rank needs for one call, built once by :func:`build_plan`.

    ``steps[j]`` are the kernel launches for the K/V block of rank ``j`` (one in the plain
    schedule; one per needed (query half, key half) pair with a window, possibly none);
    ``cu_seqlens_*_local`` are the real-row counts of this rank's own local slots and
    ``cu_seqlens_*_padded_local`` their offsets (used for the padding cleanup). ``options`` are
    the call's with ``causal=False`` (each launch sets its own). ``windowed``: every launch
    accumulates into a result allocated as ``(0, -inf)``. ``pairs`` / ``skipped``: the windowed
    schedule's launches without skipping, and how many of them were skipped. ``query_rows``
    (cp > 1): this rank's real query rows as one layout (the q side on both axes), over which the
    backward computes ``rowsum(dO * out)`` once for every launch.
    """

    cp_size: int
    cp_rank: int
    pad: bool
    exact: bool
    options: AttentionOptions
    steps: tuple[tuple[Launch, ...], ...]
    cu_seqlens_q_local: Tensor
    cu_seqlens_q_padded_local: Tensor
    cu_seqlens_kv_local: Tensor
    cu_seqlens_kv_padded_local: Tensor
    windowed: bool = False
    pairs: int = 0
    skipped: int = 0
    query_rows: VarlenLayout | None = None

    @property
    def launches(self) -> int:
        """Kernel launches of the forward (the backward has as many)."""
        return sum(len(step) for step in self.steps)


@dataclass(frozen=True)
class PlanRequest:
    """One rank's view of one ring call, as :func:`build_plan` takes it.

    ``layout``: the GLOBAL batch: real counts, slot offsets (``None``: the slots are the
    sequences) and the largest real lengths ``max_seqlen_*`` (required). ``options``: checked, as
    for :func:`thd.attention` (``causal`` is the call's). ``pad_between_seqs``: resolved; ``False``
    takes the ``cu // cp`` counts, exact only without padding. ``max_slot_*``: the largest slots,
    where known (tighter grid bounds with padding). ``sinks``: the call has sinks. ``read_layout``
    allows the one device-to-host read of a windowed call (cp > 1) that skips every pair no real
    query's window reaches; without it only the pairs ruled out whatever the lengths are skipped.
    """

    layout: VarlenLayout
    options: AttentionOptions
    cp_size: int
    cp_rank: int
    pad_between_seqs: bool
    max_slot_q: int | None = None
    max_slot_kv: int | None = None
    sinks: bool = False
    read_layout: bool = False

    @property
    def same_layout(self) -> bool:
        """Whether queries and keys share one layout (the same tensors)."""
        layout = self.layout
        return layout.cu_seqlens_kv is layout.cu_seqlens_q and layout.slots_kv is layout.slots_q


class _Bounds(NamedTuple):
    """Grid bounds of one side: real rows of a rank's local slots, and of one half of them."""

    full: int
    half: int


class _Tables(NamedTuple):
    """The ``ring_plan_tables`` of both sides (``kv is q`` for one layout): row ``h*cp + j`` is
    ``[0, *counts of rank j]`` (``h``: both halves, first, second), row ``3cp`` ``[0, *local slot
    offsets]``, row ``3cp+1`` ``[0, *local second-half starts, end]``. ``[1:]`` drops the leading
    0; a full row is the same table after one leading empty sequence."""

    q: Tensor
    kv: Tensor


def _bounds(longest: int, slot: int | None, cp: int, exact: bool) -> _Bounds:
    """Without padding every chunk is full; with it a chunk holds at most ``min(longest, slot //
    2cp)`` real rows, slots assumed to be the lengths rounded up to ``2cp`` when not known."""
    if not exact:
        return _Bounds(longest // cp, longest // (2 * cp))
    if slot is None:
        slot = -(-longest // (2 * cp)) * (2 * cp)
    return _Bounds(min(longest, slot // cp), min(longest, slot // (2 * cp)))


def _max_seqlens(layout: VarlenLayout) -> tuple[int, int]:
    if layout.max_seqlen_q is None or layout.max_seqlen_kv is None:
        raise ThdValueError(
            "build_plan: layout max_seqlen_q/max_seqlen_kv: expected ints (resolved by the caller), "
            f"got {layout.max_seqlen_q!r} and {layout.max_seqlen_kv!r}"
        )
    return layout.max_seqlen_q, layout.max_seqlen_kv


def chunk_positions(cu_q: Tensor, cu_kv: Tensor, cup: Tensor, cp: int, aligned: bool) -> Tensor:
    """int32 ``[2cp, B+1]``: row ``c`` is ``[0, *first position of chunk c of each slot]`` (the
    leading 0 belongs to the leading empty sequence of the half layouts). Positions are on the
    key axis: key chunk ``c`` starts at ``c * slot_b / 2cp``; with ``aligned`` a query chunk is
    shifted by ``Lk_b - Lq_b`` (bottom-right alignment). Device-side, a few small ops."""
    chunk = torch.div(cup[1:] - cup[:-1], 2 * cp, rounding_mode="floor")
    index = torch.arange(2 * cp, dtype=cup.dtype, device=cup.device)[:, None]
    start = index * chunk[None, :]
    if aligned:
        start = start + ((cu_kv[1:] - cu_kv[:-1]) - (cu_q[1:] - cu_q[:-1]))[None, :]
    out = cup.new_zeros(2 * cp, cup.shape[0])
    out[:, 1:] = start
    return out


def survey(
    layout: VarlenLayout, cp: int, r: int, window: tuple[int, int]
) -> tuple[int, int, list[list[bool]], list[bool]]:
    """One device-to-host read: the largest real lengths, which (query chunk, key chunk) pairs of
    rank ``r`` some real query's window reaches (``[2][2cp]``: its chunks ``r``, ``2cp-1-r``
    against every key chunk), and which of its query halves hold real rows."""
    cu_q, cu_kv, cup_q, cup_kv = layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.slots_q, layout.slots_kv
    left, right = window
    lq, lk = (cu_q[1:] - cu_q[:-1]).long(), (cu_kv[1:] - cu_kv[:-1]).long()
    cq = torch.div(cup_q[1:] - cup_q[:-1], 2 * cp, rounding_mode="floor").long()
    ck = torch.div(cup_kv[1:] - cup_kv[:-1], 2 * cp, rounding_mode="floor").long()
    a = torch.tensor([r, 2 * cp - 1 - r], device=cu_q.device)[:, None, None]  # query chunks
    c = torch.arange(2 * cp, device=cu_q.device)[None, :, None]  # key chunks
    nq = torch.minimum((lq - a * cq).clamp(min=0), cq)  # real query rows of chunk a: [2, 1, B]
    nk = torch.minimum((lk - c * ck).clamp(min=0), ck)  # [1, 2cp, B]
    q_lo = a * cq + (lk - lq)  # key-axis position of the chunk's first query
    k_lo = c * ck
    seen = (nq > 0) & (nk > 0)
    if left >= 0:  # the chunk's last key is not left of the window of its first query
        seen = seen & (k_lo + nk - 1 >= q_lo - left)
    if right >= 0:  # the chunk's first key is not right of the window of its last query
        seen = seen & (k_lo <= q_lo + nq - 1 + right)
    longest = torch.stack(
        (lq.max() if lq.numel() else lq.new_zeros(()), lk.max() if lk.numel() else lk.new_zeros(()))
    )
    host = torch.cat((longest, seen.any(-1).flatten().long(), (nq > 0).any(-1).flatten().long())).tolist()
    pairs = [[bool(x) for x in host[2 + h * 2 * cp : 2 + (h + 1) * 2 * cp]] for h in range(2)]
    return int(host[0]), int(host[1]), pairs, [bool(x) for x in host[-2:]]


def structural_pairs(cp: int, r: int, window: tuple[int, int], same_layout: bool) -> list[list[bool]]:
    """The pairs that may be reached by some window whatever the lengths: chunks ``d`` apart hold
    keys at least ``(|d| - 1) * c + 1 >= |d|`` positions from every query (chunk length ``c >=
    1``), so a side of the window narrower than ``|d|`` rules them out (causal: ``right = 0``).
    Only for identical q and kv layouts; otherwise every pair may be needed."""
    left, right = window
    pairs = []
    for a in (r, 2 * cp - 1 - r):
        row = []
        for c in range(2 * cp):
            side = right if c > a else left
            row.append(not (same_layout and side >= 0 and abs(c - a) > side))
        pairs.append(row)
    return pairs


def build_plan(request: PlanRequest) -> RingPlan:
    """The :class:`RingPlan` of ``request.cp_rank`` (device-side, no sync unless surveyed).

    The grid bounds only size the kernel grids (the kernels stride over any rows beyond them, so
    a low bound costs time, never correctness): ``max_seqlen // cp`` (``// 2cp`` for halves)
    without padding, ``min(max_seqlen, slot // 2cp)`` per chunk with it (see :class:`PlanRequest`).
    """
    layout, cp, r = request.layout, request.cp_size, request.cp_rank
    causal = request.options.causal
    options = replace(request.options, causal=False)  # each launch carries its own flag
    max_q, max_kv = _max_seqlens(layout)
    cu_q, cu_kv, cup_q, cup_kv = layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.slots_q, layout.slots_kv
    if cp == 1:
        single = VarlenLayout(cu_q, cu_kv, cup_q, cup_kv, max_q, max_kv)
        steps = ((Launch(single, causal, request.sinks),),)
        return RingPlan(1, 0, request.pad_between_seqs, True, options, steps, cu_q, cup_q, cu_kv, cup_kv)
    from thd.ops.ring_plan import ring_plan_tables  # on use: the op's reference imports thd.cp

    exact = request.pad_between_seqs
    tq = ring_plan_tables(cu_q, cup_q, cp, exact=exact)
    tables = _Tables(tq, tq if request.same_layout else ring_plan_tables(cu_kv, cup_kv, cp, exact=exact))
    bounds_q = _bounds(max_q, request.max_slot_q, cp, exact)
    bounds_kv = _bounds(max_kv, request.max_slot_kv, cp, exact)
    window = (options.window_left, -1 if causal else options.window_right)
    local = _local(tables, cp, r)
    full_q, cupl_q = local[:2]
    rows = VarlenLayout(full_q, full_q, cupl_q, cupl_q, bounds_q.full, bounds_q.full)
    if window != (-1, -1):
        pairs, sink_chunks = _window_pairs(request, window)
        if pairs is not None:
            plan = _windowed_plan(request, tables, pairs, sink_chunks, (bounds_q.half, bounds_kv.half))
            return replace(plan, query_rows=rows)
    # No window left, or causal=True with window_size=(-1, 0): the plain ring. Its off-diagonal
    # launches are not causal, so a right bound kept in the options would mask their keys by
    # each launch's own bottom-right alignment.
    steps = _plain_steps(request, tables, bounds_q, bounds_kv)
    options = replace(options, window_size=(-1, -1))
    return RingPlan(cp, r, exact, exact, options, steps, *local, query_rows=rows)


def _local(tables: _Tables, cp: int, r: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Real counts and offsets of rank ``r``'s own local slots: q counts, q offsets, kv counts, kv offsets."""
    return tables.q[r, 1:], tables.q[3 * cp, 1:], tables.kv[r, 1:], tables.kv[3 * cp, 1:]


def _window_pairs(request: PlanRequest, window: tuple[int, int]) -> tuple[list[list[bool]] | None, list[int]]:
    """``(pairs, sink_chunks)``: the (query half, key chunk) pairs to launch (``None``: the window
    covers every sequence, so run the plain schedule), and per query half the key chunk whose
    launch carries the sinks."""
    cp, r, causal = request.cp_size, request.cp_rank, request.options.causal
    sink_chunks = [r, 2 * cp - 1 - r]
    if not request.read_layout:
        same = causal or request.same_layout
        return structural_pairs(cp, r, (window[0], 0 if causal else window[1]), same), sink_chunks
    longest_q, longest_kv, pairs, has_rows = survey(request.layout, cp, r, window)
    left = -1 if window[0] >= longest_kv - 1 else window[0]  # reaches every key: no bound
    right = -1 if window[1] >= longest_q - 1 else window[1]
    if (left, right) == (-1, -1):
        return None, sink_chunks
    if request.sinks:  # the sink goes with a launched pair of each query half with real rows
        for h, a in enumerate((r, 2 * cp - 1 - r)):
            if pairs[h][a]:
                continue  # the diagonal pair runs (always, for equal q/kv layouts)
            reached = [c for c in range(2 * cp) if pairs[h][c] and not (causal and c > a)]
            if reached:
                sink_chunks[h] = reached[0]
            elif has_rows[h]:  # its queries reach no key at all: one launch for the sink
                pairs[h][a] = True
    return pairs, sink_chunks


def _plain_steps(
    request: PlanRequest, tables: _Tables, bounds_q: _Bounds, bounds_kv: _Bounds
) -> tuple[tuple[Launch, ...], ...]:
    """One launch per step (see the module docstring)."""
    cp, r, causal, sinks = request.cp_size, request.cp_rank, request.options.causal, request.sinks
    tq, tkv = tables
    full_q, cupl_q, _, cupl_kv = _local(tables, cp, r)
    mq, mkv = bounds_q.full, bounds_kv.full
    if not causal:
        layouts = [VarlenLayout(full_q, tkv[j, 1:], cupl_q, cupl_kv, mq, mkv) for j in range(cp)]
        return tuple((Launch(lay, False, sinks and j == r),) for j, lay in enumerate(layouts))
    steps = []
    for j in range(cp):
        if j == r:
            step = Launch(VarlenLayout(full_q, full_q, cupl_q, cupl_kv, mq, mkv), True, sinks)
        elif j < r:  # all local queries, first half of KV_j
            step = Launch(VarlenLayout(full_q, tkv[cp + j, 1:], cupl_q, cupl_kv, mq, bounds_kv.half), False)
        else:  # the second half of the queries (offsets at the half starts), all of KV_j
            second = VarlenLayout(tq[2 * cp + r], tkv[j], tq[3 * cp + 1], tkv[3 * cp], bounds_q.half, mkv)
            step = Launch(second, False)
        steps.append((step,))
    return tuple(steps)


def _windowed_plan(
    request: PlanRequest,
    tables: _Tables,
    pairs: list[list[bool]],
    sink_chunks: list[int],
    half_bounds: tuple[int, int],
) -> RingPlan:
    """One launch per needed (query half, key half) pair of every step. Half layouts have one
    leading empty sequence (full table rows), so both halves of either side share one form;
    positions put chunk ``c`` of slot ``b`` at ``c * slot_b / 2cp`` on the key axis."""
    layout, cp, r, causal = request.layout, request.cp_size, request.cp_rank, request.options.causal
    cu_q, cu_kv = layout.cu_seqlens_q, layout.cu_seqlens_kv
    pos_kv = chunk_positions(cu_q, cu_kv, layout.slots_kv, cp, aligned=False)
    pos_q = pos_kv if request.same_layout else chunk_positions(cu_q, cu_kv, layout.slots_q, cp, aligned=True)
    tq, tkv = tables
    # (chunk, counts, offsets) of each half: chunk r / 2cp-1-r, first / second half tables.
    q_halves = ((r, tq[cp + r], tq[3 * cp]), (2 * cp - 1 - r, tq[2 * cp + r], tq[3 * cp + 1]))
    steps: list[tuple[Launch, ...]] = []
    total = 0
    for j in range(cp):
        launches = []
        kv_halves = ((j, tkv[cp + j], tkv[3 * cp]), (2 * cp - 1 - j, tkv[2 * cp + j], tkv[3 * cp + 1]))
        for h, (a, cu_a, cup_a) in enumerate(q_halves):
            for c, cu_c, cup_c in kv_halves:
                if causal and c > a:
                    continue  # not a pair of the causal schedule at all
                total += 1
                if not pairs[h][c]:
                    continue
                half = VarlenLayout(cu_a, cu_c, cup_a, cup_c, *half_bounds, pos_q[a], pos_kv[c])
                launches.append(Launch(half, causal, request.sinks and c == sink_chunks[h]))
        steps.append(tuple(launches))
    pad, options = request.pad_between_seqs, replace(request.options, causal=False)
    local = _local(tables, cp, r)
    plan = RingPlan(cp, r, pad, pad, options, tuple(steps), *local, windowed=True, pairs=total)
    return replace(plan, skipped=total - plan.launches)
