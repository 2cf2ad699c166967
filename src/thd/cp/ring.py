"""Ring (P2P) context-parallel attention over the load-balanced THD layout; owns no kernels.

Rank ``r`` of a ``cp``-rank group holds chunks ``r`` and ``2cp-1-r`` of every slot
(:func:`thd.cp.partition`). Forward: K and V travel to the next rank (two messages of one
batched exchange, posted before the step's compute and waited on after it); at step
``i`` rank ``r`` attends its queries to the K/V of rank ``j = (r - i) mod cp``. Causal sections
(spec §3.2): ``j == r`` diagonal (causal inside each local slot), ``j < r`` lower (all local
queries, first half of KV_j, no mask), ``j > r`` upper (second half of the local queries, all of
KV_j, no mask); without ``causal`` every step is full. The first step writes ``(out, lse)``;
each later step's kernel continues the online softmax from it in place (fp32, NaN-safe for rows
no key has reached), so no separate merge pass runs. Backward runs the ring the other way
and the partial dK/dV of each K/V block travels with it, so each rank ends with the complete
gradient of its own block.

Halves are never copied. Padding sits at the end of a slot, so the real rows of each half of a
local slot are a prefix of that half: the first half of KV_j is the local slot offsets with
first-half counts, and the second half of the queries is described by offsets at the half
starts (after one leading empty sequence, so offsets start at 0) with second-half counts. The
forward leaves every other row of the running result untouched, and the backward kernels write
exact zeros there, so per-step gradients are full-size and are simply added.

Per-step counts are those of :func:`thd.cp.rank_cu_seqlens`, all built in one launch per call
(:func:`thd.ops.ring_plan.ring_plan_tables`) and reused by the backward, whenever the layout
has padding; the ``cu // cp`` fast path is taken only when ``pad_between_seqs`` resolves to
False, where it is exact. :data:`path_counts` records which path each call took.

Variants. ``softcap`` goes to every launch. ``sinks`` enter each row's softmax denominator
once: through the first step (the diagonal, which covers every local query row), later steps
accumulate into an ``lse`` that already holds the sink; the backward takes ``dsinks`` from that
one step (each step's backward uses the merged ``out``/``lse``, so ``P = exp(s - lse)`` needs no
sink). With a sliding ``window_size`` a local slot's two halves (chunks ``r`` and ``2cp-1-r``)
are not contiguous in position, so each step runs one launch per (query half, key half) pair
that some query's window reaches, each placed on the sequence's position axis by
``VarlenLayout.positions_q/kv`` (chunk index times chunk length); every launch accumulates into
``(out = 0, lse = -inf)`` allocated once (fp32), and the sink goes with the diagonal pair of each
query half. Pairs no window reaches are skipped (:data:`window_counts`); a window that covers
whole sequences is dropped and the call runs the plain schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from thd._capture import is_capturing
from thd.cp.checks import (
    check_metadata,
    check_shards,
    check_values,
    check_variants,
    max_len,
    resolve_max_seqlen,
)
from thd.cp.comm import P2P, RingComm, resolve_group
from thd.cp.transport import ring_comm
from thd.errors import ThdError
from thd.ops.attention.dispatch import backward_call, forward_call, runs_kernels
from thd.ops.attention.params import (
    AttentionOptions,
    BackwardCall,
    ForwardCall,
    SavedForBackward,
    VarlenLayout,
)

__all__ = ["Launch", "RingPlan", "build_plan", "path_counts", "ring_attention", "window_counts"]

path_counts: Counter[str] = Counter()
"""Calls per count path: ``"rank_counts"`` (exact, from :func:`thd.cp.rank_cu_seqlens`),
``"fast"`` (``cu_seqlens // cp``, only without padding) and ``"single"`` (cp = 1)."""

window_counts: Counter[str] = Counter()
"""Sliding-window calls (cp > 1): ``"calls"``; ``"covering"``: the window covered every
sequence, so the call ran the plain schedule; ``"pairs"``: (query half, key half) launches the
windowed schedule needs without skipping (causality already excluded: ``2cp + 1`` per causal
call, ``4cp`` otherwise); ``"launches"``: those it ran; ``"skipped"``: the difference. Each
count holds for the forward and again for the backward."""

_FN = "ring_attention"
_KV, _DKV = 0, 1  # message kinds, part of the p2p tag


def _clean_padding(plan: RingPlan, out: Tensor | None = None, grads: tuple[Tensor, ...] = ()) -> None:
    """Exact zeros on the padding rows of ``out`` (query layout) and ``(dq, dk, dv)``; only
    when the layout has padding, and only after the torch reference: the Triton kernels already
    write exact zeros on every row outside a launch's real rows (forward and backward), which
    the ring relies on anyway when it adds per-step results, so their padding rows are zero."""
    if not plan.pad:
        return
    x = out if out is not None else grads[0]
    if runs_kernels(x):
        return
    from thd.padding import zero_padding_  # imported on use: thd.padding imports Triton

    q_layout = (plan.cu_seqlens_q_local, plan.cu_seqlens_q_padded_local)
    kv_layout = (plan.cu_seqlens_kv_local, plan.cu_seqlens_kv_padded_local)
    targets = [(out, q_layout)] if out is not None else []
    if grads:
        targets += zip(grads, (q_layout, kv_layout, kv_layout), strict=True)
    for x, (cu, cup) in targets:
        zero_padding_(x, cu, cup, pad_between_seqs=True)


def _resolve_pad(explicit: bool | None, cu: Tensor, cup: Tensor | None, cp: int) -> bool:
    from thd.padding import resolve_pad_between_seqs

    return resolve_pad_between_seqs(explicit, cu, cup, cp_size=cp)


def _host_reads_allowed(q: Tensor, max_seqlen_q: int | None, max_seqlen_kv: int | None) -> bool:
    """Whether the call validates its layout and may read device memory: not under capture, and
    CPU tensors or a ``max_seqlen_*`` not given."""
    return not is_capturing() and (q.device.type != "cuda" or max_seqlen_q is None or max_seqlen_kv is None)


def _tag(step: int, kind: int) -> int:
    """Base p2p tag of a step's message kind; the tensors of one message take ``base + index``."""
    return 4 * step + 2 * kind


_CAUSAL: dict[AttentionOptions, AttentionOptions] = {}  # base options -> with the other causal flag


@dataclass(frozen=True)
class Launch:
    """One attention kernel call of a ring step: its layout, whether it is causal, and whether
    it carries the sink term (forward) and returns ``dsinks`` (backward)."""

    layout: VarlenLayout
    causal: bool
    sinks: bool = False

    def _options(self, base: AttentionOptions) -> AttentionOptions:
        if base.causal == self.causal:
            return base
        options = _CAUSAL.get(base)  # by value: calls with the same options share one entry
        if options is None:
            if len(_CAUSAL) >= 64:
                _CAUSAL.clear()
            options = _CAUSAL[base] = replace(base, causal=self.causal)
        return options

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        options: AttentionOptions,
        sinks: Tensor | None = None,
        accumulate: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)``, zeros / ``-inf`` outside this launch's rows;
        with ``accumulate`` this launch is merged into that partial result in place instead.
        ``sinks`` is used only when this launch carries them."""
        carried = sinks if self.sinks else None
        call = ForwardCall(q, k, v, self.layout, self._options(options), carried, accumulate)
        return forward_call(call)

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        options: AttentionOptions,
        sinks: Tensor | None = None,
        accumulate: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(dq, dk, dv, dsinks)`` of this launch from the merged ``out`` and ``lse``; ``dsinks``
        (over this launch's real query rows) only when it carries the sinks. With
        ``accumulate=(dq, dk, dv)`` (fp32) the gradients are added into those buffers instead."""
        saved = SavedForBackward(q, k, v, out, lse, sinks if self.sinks else None)
        return backward_call(BackwardCall(do, saved, self.layout, self._options(options), accumulate))


def _launch(
    cu_q: Tensor,
    cu_kv: Tensor,
    cup_q: Tensor,
    cup_kv: Tensor,
    max_q: int,
    max_kv: int,
    causal: bool,
    sinks: bool = False,
) -> tuple[Launch]:
    """A step of one launch (the plain schedule)."""
    return (Launch(VarlenLayout(cu_q, cu_kv, cup_q, cup_kv, max_q, max_kv), causal, sinks),)


@dataclass(frozen=True)
class RingPlan:
    """Everything a rank needs for one call, built once by :func:`build_plan`.

    ``steps[j]`` are the kernel launches for the K/V block of rank ``j`` (one in the plain
    schedule; one per needed (query half, key half) pair with a window, possibly none);
    ``cu_seqlens_*_local`` are the real-row counts of this rank's own local slots and
    ``cu_seqlens_*_padded_local`` their offsets (used for the padding cleanup). ``windowed``:
    every launch accumulates into a result allocated as ``(0, -inf)``. ``pairs`` / ``skipped``:
    the windowed schedule's launches without skipping, and how many of them were skipped.
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

    @property
    def launches(self) -> int:
        """Kernel launches of the forward (the backward has as many)."""
        return sum(len(step) for step in self.steps)


def _chunk_positions(cu_q: Tensor, cu_kv: Tensor, cup: Tensor, cp: int, aligned: bool) -> Tensor:
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


def _survey(
    cu_q: Tensor, cup_q: Tensor, cu_kv: Tensor, cup_kv: Tensor, cp: int, r: int, window: tuple[int, int]
) -> tuple[int, int, list[list[bool]], list[bool]]:
    """One device-to-host read: the largest real lengths, which (query chunk, key chunk) pairs of
    rank ``r`` some real query's window reaches (``[2][2cp]``: its chunks ``r``, ``2cp-1-r``
    against every key chunk), and which of its query halves hold real rows."""
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


def _structural_pairs(cp: int, r: int, window: tuple[int, int], same_layout: bool) -> list[list[bool]]:
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


def build_plan(
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor,
    cu_seqlens_kv_padded: Tensor,
    *,
    cp_size: int,
    cp_rank: int,
    causal: bool,
    pad_between_seqs: bool,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    max_slot_q: int | None = None,
    max_slot_kv: int | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: bool = False,
    read_layout: bool = False,
) -> RingPlan:
    """Per-step counts, offsets and length bounds of rank ``cp_rank`` (device-side, no sync).

    ``cu_seqlens_*`` are the global real counts, ``cu_seqlens_*_padded`` the global slot offsets
    and ``max_seqlen_*`` the largest global real lengths. The bounds only size the kernel grids
    (the kernels stride over any rows beyond them, so a low bound costs time, never
    correctness). Without padding every chunk is full and they are ``max_seqlen // cp``
    (``// 2cp`` for halves). With padding a chunk holds at most ``min(max_seqlen, slot // 2cp)``
    real rows: with the largest slot ``max_slot_*`` known that is the bound; otherwise slots are
    assumed to be the lengths rounded up to ``2cp`` (the usual padding), which is exact for
    them and only an estimate when a short sequence sits in a much longer slot.

    ``window_size`` (checked, as for :func:`thd.attention`) with cp > 1 builds the windowed
    schedule: one launch per (query half, key half) pair, placed by positions. ``sinks``: the
    call has sinks (they go with the first step, or with each query half's diagonal pair).
    ``read_layout`` allows one device-to-host read (only with a window, cp > 1) that skips
    every pair no real query's window reaches and drops a window that covers every sequence;
    without it only the pairs ruled out whatever the lengths are skipped.
    """
    cu_q, cu_kv, cup_q, cup_kv = cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded
    cp, r = cp_size, cp_rank
    options = AttentionOptions(softmax_scale, False, tuple(window_size), softcap)  # type: ignore[arg-type]
    if cp == 1:
        steps = (_launch(cu_q, cu_kv, cup_q, cup_kv, max_seqlen_q, max_seqlen_kv, causal, sinks),)
        return RingPlan(1, 0, pad_between_seqs, True, options, steps, cu_q, cup_q, cu_kv, cup_kv)
    exact = pad_between_seqs

    def bounds(longest: int, slot: int | None) -> tuple[int, int]:
        if not exact:
            return longest // cp, longest // (2 * cp)
        if slot is None:
            slot = -(-longest // (2 * cp)) * (2 * cp)
        return min(longest, slot // cp), min(longest, slot // (2 * cp))

    mq, mq_half = bounds(max_seqlen_q, max_slot_q)
    mkv, mkv_half = bounds(max_seqlen_kv, max_slot_kv)
    # Every table below is a view of one or two ring_plan_tables results (one launch each):
    # row h*cp + j holds [0, *counts of rank j] (h: both halves, first, second), row 3cp
    # [0, *local slot offsets], row 3cp+1 [0, *local second-half starts, end]; [1:] drops the
    # leading 0, the full row is the same table after one leading empty sequence.
    from thd.ops.ring_plan import ring_plan_tables  # on use: the op's reference imports thd.cp

    tq = ring_plan_tables(cu_q, cup_q, cp, exact=exact)
    same_kv = cu_kv is cu_q and cup_kv is cup_q
    tkv = tq if same_kv else ring_plan_tables(cu_kv, cup_kv, cp, exact=exact)
    cupl_q, cupl_kv = tq[3 * cp, 1:], tkv[3 * cp, 1:]
    full_q = tq[r, 1:]
    local = (full_q, cupl_q, tkv[r, 1:], cupl_kv)
    window = (options.window_left, -1 if causal else options.window_right)
    pairs: list[list[bool]] | None = None
    sink_chunks = [r, 2 * cp - 1 - r]  # per query half, the key chunk whose launch carries the sinks
    if window != (-1, -1):
        if read_layout:
            longest_q, longest_kv, pairs, has_rows = _survey(cu_q, cup_q, cu_kv, cup_kv, cp, r, window)
            left = -1 if window[0] >= longest_kv - 1 else window[0]  # reaches every key: no bound
            right = -1 if window[1] >= longest_q - 1 else window[1]
            if (left, right) == (-1, -1):
                window, pairs = (-1, -1), None
                options = replace(options, window_size=(-1, -1))
            elif sinks:  # the sink goes with a launched pair of each query half with real rows
                for h, a in enumerate((r, 2 * cp - 1 - r)):
                    if pairs[h][a]:
                        continue  # the diagonal pair runs (always, for equal q/kv layouts)
                    reached = [c for c in range(2 * cp) if pairs[h][c] and not (causal and c > a)]
                    if reached:
                        sink_chunks[h] = reached[0]
                    elif has_rows[h]:  # its queries reach no key at all: one launch for the sink
                        pairs[h][a] = True
        else:
            pairs = _structural_pairs(cp, r, (window[0], 0 if causal else window[1]), causal or same_kv)
    if pairs is not None:
        return _windowed_plan(
            cu_q, cu_kv, cup_q, cup_kv, tq, tkv, pairs, cp, r, causal,
            sink_chunks if sinks else None, options, pad_between_seqs, mq_half, mkv_half, local,
        )  # fmt: skip
    # No window left, or causal=True with window_size=(-1, 0): the plain ring. Its off-diagonal
    # launches are not causal, so a right bound kept in the options would mask their keys by
    # each launch's own bottom-right alignment.
    options = replace(options, window_size=(-1, -1))
    steps: list[tuple[Launch, ...]] = []
    if not causal:
        for j in range(cp):
            steps.append(_launch(full_q, tkv[j, 1:], cupl_q, cupl_kv, mq, mkv, False, sinks and j == r))
    else:
        second_q, second_q_padded, kv_padded_shifted = tq[2 * cp + r], tq[3 * cp + 1], tkv[3 * cp]
        for j in range(cp):
            if j == r:
                step = _launch(full_q, full_q, cupl_q, cupl_kv, mq, mkv, True, sinks)
            elif j < r:
                step = _launch(full_q, tkv[cp + j, 1:], cupl_q, cupl_kv, mq, mkv_half, False)
            else:
                step = _launch(second_q, tkv[j], second_q_padded, kv_padded_shifted, mq_half, mkv, False)
            steps.append(step)
    return RingPlan(cp, r, pad_between_seqs, exact, options, tuple(steps), *local)


def _windowed_plan(
    cu_q: Tensor,
    cu_kv: Tensor,
    cup_q: Tensor,
    cup_kv: Tensor,
    tq: Tensor,
    tkv: Tensor,
    pairs: list[list[bool]],
    cp: int,
    r: int,
    causal: bool,
    sink_chunks: list[int] | None,
    options: AttentionOptions,
    pad: bool,
    mq_half: int,
    mkv_half: int,
    local: tuple[Tensor, Tensor, Tensor, Tensor],
) -> RingPlan:
    """One launch per needed (query half, key half) pair of every step. Half layouts have one
    leading empty sequence (full table rows), so both halves of either side share one form;
    positions put chunk ``c`` of slot ``b`` at ``c * slot_b / 2cp`` on the key axis.
    ``sink_chunks`` (``None`` without sinks): per query half, the key chunk of its launch that
    carries the sinks."""
    pos_kv = _chunk_positions(cu_q, cu_kv, cup_kv, cp, aligned=False)
    same = cu_kv is cu_q and cup_kv is cup_q
    pos_q = pos_kv if same else _chunk_positions(cu_q, cu_kv, cup_q, cp, aligned=True)
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
                layout = VarlenLayout(cu_a, cu_c, cup_a, cup_c, mq_half, mkv_half, pos_q[a], pos_kv[c])
                launches.append(Launch(layout, causal, sink_chunks is not None and c == sink_chunks[h]))
        steps.append(tuple(launches))
    plan = RingPlan(cp, r, pad, pad, options, tuple(steps), *local, windowed=True, pairs=total)
    return replace(plan, skipped=total - plan.launches)


def _exchange(
    comm: RingComm, tensors: tuple[Tensor, Tensor], offset: int, tag: int
) -> tuple[list[Tensor], list[P2P]]:
    """Receive buffers, and the ops that send the two ``tensors`` ``offset`` places on and receive
    the matching tensors from ``offset`` places back (tensor ``i`` travels with tag ``tag + i``)."""
    a, b = tensors
    received = [torch.empty_like(a), torch.empty_like(b)]
    ra, rb = received
    ops = [comm.send(a, offset, tag), comm.send(b, offset, tag + 1)]
    ops += (comm.recv(ra, -offset, tag), comm.recv(rb, -offset, tag + 1))
    return received, ops


def _forward_step(
    launches: tuple[Launch, ...],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: AttentionOptions,
    sinks: Tensor | None,
    acc: tuple[Tensor, Tensor] | None,
    fp32: bool,
) -> tuple[Tensor, Tensor] | None:
    """Fold one step's launches into ``acc``; without ``acc`` the first launch writes a fresh
    result (kept in fp32 when ``fp32``)."""
    for launch in launches:
        if acc is None:
            out, lse = launch.forward(q, k, v, options, sinks)
            acc = (out.float() if fp32 else out), lse
        else:
            launch.forward(q, k, v, options, sinks, accumulate=acc)
    return acc


def _empty_result(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(out = 0 fp32, lse = -inf)``: the start of a windowed forward (every launch accumulates)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, plan: RingPlan, comm: RingComm, overlap: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, lse, k_last, v_last)``; ``*_last`` are the K/V of rank ``r + 1`` (start of the backward).

    The first step writes a fresh ``(out, lse)``; every later step folds its keys into it in
    place inside the attention kernel (no separate merge pass). With more than two steps the
    running result is kept in fp32 and rounded to ``q.dtype`` once at the end. A windowed plan
    starts from ``(0, -inf)`` in fp32 and every launch accumulates (each writes only its rows).
    """
    cp, r, options = plan.cp_size, plan.cp_rank, plan.options
    acc = _empty_result(q, v) if plan.windowed else None
    for i in range(cp):
        j = (r - i) % cp
        pending = received = None
        if i + 1 < cp:  # post the next step's exchange before this step's compute
            received, ops = _exchange(comm, (k, v), +1, _tag(i + 1, _KV))
            pending = comm.start(ops)
            if not overlap:
                pending.wait()
        acc = _forward_step(plan.steps[j], q, k, v, options, sinks, acc, cp > 2)
        if pending is not None and received is not None:
            pending.wait()
            k, v = received
    assert acc is not None
    out, lse = acc[0].to(q.dtype), acc[1]
    _clean_padding(plan, out)
    return out, lse, k, v


def _backward_step(
    launches: tuple[Launch, ...],
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    options: AttentionOptions,
    sinks: Tensor | None,
    dq_acc: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``(dq, dk, dv, dsinks)`` of one step (``None`` where no launch contributes). Plain
    schedule (one launch): its results as they are. Windowed (``dq_acc``, fp32): every launch
    adds its dQ into ``dq_acc`` and its dK/dV into one fp32 buffer each, rounded once to the
    input dtypes; ``dq`` is then ``dq_acc`` and ``dsinks`` the fp32 sum of the launches' parts."""
    if dq_acc is None:
        (launch,) = launches
        return launch.backward(do, q, k, v, out, lse, options, sinks)
    if not launches:
        return None, None, None, None
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    dsinks = None
    for launch in launches:
        ds_i = launch.backward(do, q, k, v, out, lse, options, sinks, accumulate=(dq_acc, dk, dv))[3]
        if ds_i is not None:
            dsinks = ds_i.float() if dsinks is None else dsinks.add_(ds_i)
    return dq_acc, dk.to(k.dtype), dv.to(v.dtype), dsinks


def _ring_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    sinks: Tensor | None,
    plan: RingPlan,
    comm: RingComm,
    overlap: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Reverse ring: at step ``i`` rank ``r`` holds K/V of rank ``(r + 1 + i) mod cp`` and the
    partial dK/dV of that block (summed over the ranks that held it before), adds its own part
    and passes both on; at the last step the block is its own and the gradient is complete.
    ``dsinks`` is this rank's part (its real query rows), from the launches that carry sinks."""
    cp, r, options = plan.cp_size, plan.cp_rank, plan.options
    # windowed: one fp32 dQ buffer every launch of every step adds into
    window_dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if plan.windowed else None
    dq_acc: Tensor | None = window_dq
    dsinks: Tensor | None = None
    dkv: tuple[Tensor, Tensor] | None = None
    for i in range(cp):
        j = (r + 1 + i) % cp
        ops: list[P2P] = []
        dkv_in = kv_next = None
        if dkv is not None:  # i > 0: pass the finished partial on, receive the next one
            dkv_in, dkv_ops = _exchange(comm, dkv, -1, _tag(i, _DKV))
            ops += dkv_ops
        if i + 1 < cp:
            kv_next, kv_ops = _exchange(comm, (k, v), -1, _tag(i + 1, _KV))
            ops += kv_ops
        pending = comm.start(ops)
        if not overlap:
            pending.wait()
        dq_i, dk_i, dv_i, ds_i = _backward_step(
            plan.steps[j], do, q, k, v, out, lse, options, sinks, window_dq
        )
        if ds_i is not None:
            dsinks = ds_i if dsinks is None else dsinks + ds_i
        if window_dq is not None or dq_i is None:
            pass  # windowed: the step's launches added their parts into dq_acc already
        elif dq_acc is None:  # two parts: one add in q.dtype rounds exactly like an fp32 sum + cast
            dq_acc = dq_i if cp == 2 else dq_i.float()
        elif i + 1 == cp and dq_acc.dtype != q.dtype:  # last part: round once into q.dtype
            dq_acc = torch.add(dq_acc, dq_i, out=torch.empty_like(q))
        else:
            dq_acc.add_(dq_i)
        pending.wait()
        if dk_i is None or dv_i is None:  # nothing to add: pass the block's partial on as it is
            dkv = (torch.zeros_like(k), torch.zeros_like(v)) if dkv_in is None else (dkv_in[0], dkv_in[1])
        elif dkv_in is None:
            dkv = (dk_i, dv_i)
        else:
            dkv_in[0].add_(dk_i)
            dkv_in[1].add_(dv_i)
            dkv = (dkv_in[0], dkv_in[1])
        if kv_next is not None:
            k, v = kv_next
    assert dkv is not None
    dq = torch.zeros_like(q) if dq_acc is None else dq_acc.to(q.dtype)
    dk, dv = dkv
    _clean_padding(plan, grads=(dq, dk, dv))
    return dq, dk, dv, dsinks


def _single_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, plan: RingPlan
) -> tuple[Tensor, Tensor]:
    out, lse = plan.steps[0][0].forward(q, k, v, plan.options, sinks)
    _clean_padding(plan, out)
    return out, lse


def _forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, plan: RingPlan, comm: RingComm, overlap: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, lse, k_last, v_last)``: the K/V the backward starts from (``k, v`` at cp = 1)."""
    if plan.cp_size == 1:
        return (*_single_forward(q, k, v, sinks, plan), k, v)
    return _ring_forward(q, k, v, sinks, plan, comm, overlap)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the forward and reverse rings. The gradient of ``sinks`` is this
    rank's part (over its own query rows); the caller sums it over the group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        plan: RingPlan,
        comm: RingComm,
        overlap: bool,
    ) -> tuple[Tensor, Tensor]:
        out, lse, k_last, v_last = _forward(q, k, v, sinks, plan, comm, overlap)
        ctx.save_for_backward(q, k_last, v_last, out, lse, sinks)
        ctx.plan, ctx.comm, ctx.overlap = plan, comm, overlap  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is auxiliary and carries no gradient
        plan: RingPlan = ctx.plan  # type: ignore[attr-defined]
        dout = dout.contiguous()
        q, k, v, out, lse, sinks = ctx.saved_tensors  # type: ignore[attr-defined]
        if plan.cp_size == 1:
            dq, dk, dv, dsinks = plan.steps[0][0].backward(dout, q, k, v, out, lse, plan.options, sinks)
            _clean_padding(plan, grads=(dq, dk, dv))
        else:  # k, v: the K/V of rank r + 1, where the reverse ring starts
            dq, dk, dv, dsinks = _ring_backward(dout, q, k, v, out, lse, sinks, plan, ctx.comm, ctx.overlap)  # type: ignore[attr-defined]
        if sinks is None:
            dsinks = None
        elif dsinks is None:  # no real query row on this rank
            dsinks = torch.zeros_like(sinks)
        else:
            dsinks = dsinks.to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None


# ----------------------------------------------------------------------------- public API


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    pad_between_seqs: bool | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    _overlap: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Context-parallel ring attention on this rank's THD shard; differentiable.

    Args:
        q: ``[T/cp, Hq, D]`` this rank's query shard from :func:`thd.cp.partition`.
        k: ``[T/cp, Hkv, D]`` key shard, ``Hq % Hkv == 0`` (GQA).
        v: ``[T/cp, Hkv, Dv]`` value shard (``Dv`` may differ from ``D``).
        cu_seqlens_q, cu_seqlens_kv: int32 ``[B+1]`` cumulative real lengths of the GLOBAL batch.
        cu_seqlens_q_padded, cu_seqlens_kv_padded: int32 ``[B+1]`` GLOBAL slot offsets, every
            slot a multiple of ``2 * cp`` long (``None``: the slots are the sequences).
        group: the context-parallel process group (default: the world group); its size is cp.
        causal: causal self-attention (q and kv layouts must be identical); else every query
            sees every key of its sequence.
        softmax_scale: defaults to ``D ** -0.5``.
        pad_between_seqs: whether the layout has padding under CP; ``None`` detects it with
            :func:`thd.padding.detect_pad_between_seqs` (``cp_size`` = group size). ``False``
            takes the ``cu // cp`` fast path, which is wrong if there is any padding.
        max_seqlen_q, max_seqlen_kv: largest GLOBAL real lengths. With both given (on CUDA)
            the call performs no host sync and no value validation, so it can be captured in a
            CUDA graph; otherwise the layout is validated (one device-to-host read and one
            small all-gather that checks the shard shapes of all ranks).
        window_size: ``(left, right)`` sliding window, as for :func:`thd.attention` (bottom-right
            aligned over each whole sequence: with equal q/kv layouts query ``i`` sees key ``j``
            iff ``i - left <= j <= i + right``; ``-1`` is unbounded; ``causal`` is ``right = 0``).
            Steps run one launch per (query half, key half) pair some window reaches; where a
            host read is allowed (see ``max_seqlen_*``) the others are skipped exactly
            (:data:`window_counts`), and a window covering every sequence runs the plain
            schedule.
        softcap: when > 0, scores are ``softcap * tanh(q.k * scale / softcap)``.
        sinks: ``[Hq]`` logits (differentiable): each real query row's softmax denominator gets
            one ``exp(sinks[h])``; ``lse`` includes it. The gradient of ``sinks`` on each rank is
            that rank's part (its own query rows): sum it over the group, as for any parameter
            replicated across the CP ranks (data-parallel gradient reduction over the DP x CP
            ranks does that).
        return_lse: also return the merged log-sum-exp.
        _overlap: private; ``False`` waits for each exchange before the step's compute (the
            "no overlap" baseline of ``benchmarks/bench_ring.py``).

    Returns:
        ``out [T/cp, Hq, Dv]`` in ``q.dtype`` (exact zeros on padding rows) and, with
        ``return_lse``, ``lse [Hq, T/cp]`` fp32 (``-inf`` on padding rows). The backward
        returns this rank's ``dq, dk, dv`` with exact zeros on padding rows.

    Raises:
        ThdDistributedError: no initialised process group, or another rank rejected its inputs.
        ThdValueError / ThdTypeError: bad shapes, dtypes or layout (slot lengths not a multiple
            of ``2 * cp``, shard rows that do not match ``cu_seqlens_*_padded[-1] / cp``, shard
            shapes that differ across ranks); a window side below -1, ``right > 0`` with
            ``causal``, a negative or non-finite ``softcap``, sinks of the wrong shape, dtype or
            device.

    Example (torchrun --nproc-per-node=2)::

        >>> cu = torch.tensor([0, 698, 1000], dtype=torch.int32, device="cuda")
        >>> cup = torch.tensor([0, 704, 1008], dtype=torch.int32, device="cuda")
        >>> q_r = thd.cp.partition(q, cup, cp, rank)  # likewise k, v
        >>> out_r = thd.cp.ring_attention(q_r, k_r, v_r, cu, cu, cup, cup, causal=True)
    """
    grp = resolve_group(_FN, group)
    comm = ring_comm(grp, q)  # the transport: chosen on the first call with grp, then cached
    cp = comm.size
    sync_ok = _host_reads_allowed(q, max_seqlen_q, max_seqlen_kv)
    error: Exception | None = None
    options = AttentionOptions(1.0)
    try:
        check_metadata(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            causal,
            max_seqlen_q,
            max_seqlen_kv,
        )
        options = check_variants(q, causal, softmax_scale, window_size, softcap, sinks)
    except ThdError as exc:
        error = exc
    if sync_ok and cp > 1:
        check_shards(comm, q, k, v, error)
    elif error is not None:
        raise error
    if sync_ok:
        check_values(
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            cp,
            q.shape[0],
            k.shape[0],
            causal,
            max_seqlen_q,
            max_seqlen_kv,
        )
    cup_q = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
    cup_kv = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
    pad = _resolve_pad(pad_between_seqs, cu_seqlens_q, cu_seqlens_q_padded, cp)
    if pad_between_seqs is None and not pad:
        pad = _resolve_pad(None, cu_seqlens_kv, cu_seqlens_kv_padded, cp)
    plan = build_plan(
        cu_seqlens_q,
        cu_seqlens_kv,
        cup_q,
        cup_kv,
        cp_size=cp,
        cp_rank=comm.rank,
        causal=bool(causal),
        pad_between_seqs=pad,
        max_seqlen_q=resolve_max_seqlen("max_seqlen_q", cu_seqlens_q, max_seqlen_q),
        max_seqlen_kv=resolve_max_seqlen("max_seqlen_kv", cu_seqlens_kv, max_seqlen_kv),
        softmax_scale=options.softmax_scale,
        max_slot_q=max_len(cup_q) if sync_ok and pad and cp > 1 else None,
        max_slot_kv=max_len(cup_kv) if sync_ok and pad and cp > 1 else None,
        window_size=options.window_size,
        softcap=options.softcap,
        sinks=sinks is not None,
        read_layout=sync_ok,
    )
    path_counts["single" if cp == 1 else "rank_counts" if plan.exact else "fast"] += 1
    if cp > 1 and (options.window_left >= 0 or (not causal and options.window_size[1] >= 0)):
        window_counts["calls"] += 1
        if plan.windowed:
            window_counts.update(pairs=plan.pairs, launches=plan.launches, skipped=plan.skipped)
        else:
            window_counts["covering"] += 1
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    ):
        out, lse = RingAttentionFunction.apply(q, k, v, sinks, plan, comm, bool(_overlap))
    else:  # nothing to differentiate: the forward without autograd.Function's dispatch
        out, lse = _forward(q, k, v, sinks, plan, comm, bool(_overlap))[:2]
    return (out, lse) if return_lse else out
