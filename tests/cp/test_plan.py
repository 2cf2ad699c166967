"""Property tests of :mod:`thd.cp.plan` on CPU, without processes or attention kernels.

The oracle is independent of the plan: the visible (query row, key row) pairs of the unsharded
batch (bottom-right aligned causal/window mask per sequence, real rows only), against the pairs
the plan's launches make visible once their local rows are mapped back to global rows by the
dual-chunk rule (rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of every slot).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from thd.cp.plan import Launch, PlanRequest, RingPlan, build_plan
from thd.ops.attention.params import AttentionOptions, VarlenLayout

pytestmark = pytest.mark.property


@pytest.fixture(autouse=True)
def _torch_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan tables through their torch reference (the interpreter would run the kernel)."""
    importlib.import_module("thd.ops.ring_plan.kernels")  # decorated for the interpreter now
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@dataclass(frozen=True)
class Side:
    """Real lengths and slot lengths of one side (q or kv) of the global batch."""

    lens: tuple[int, ...]
    slots: tuple[int, ...]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(  # type: ignore[return-value]
            torch.tensor([0, *accumulate(xs)], dtype=torch.int32) for xs in (self.lens, self.slots)
        )

    def global_row(self, cp: int, rank: int, local: int) -> int:
        """The global row of local row ``local`` of ``rank``: slot ``b``'s local rows are its chunk
        ``rank`` then its chunk ``2cp-1-rank``."""
        start = 0
        for b, slot in enumerate(self.slots):
            chunk = slot // (2 * cp)
            if local < start + 2 * chunk:
                o = local - start
                index = rank if o < chunk else 2 * cp - 1 - rank
                return sum(self.slots[:b]) + index * chunk + o % chunk
            start += 2 * chunk
        raise AssertionError(f"local row {local} of rank {rank} is past the last slot")

    def is_real(self, row: int) -> bool:
        start = 0
        for n, slot in zip(self.lens, self.slots, strict=True):
            if start <= row < start + slot:
                return row - start < n
            start += slot
        return False


@dataclass(frozen=True)
class Call:
    cp: int
    q: Side
    kv: Side
    kv_mode: str  # "same": the q tensors; "copy": equal values, other tensors; "cross": other lengths
    options: AttentionOptions
    sinks: bool
    pad: bool
    read_layout: bool
    max_slots: bool

    def requests(self) -> Iterator[PlanRequest]:
        cu_q, cup_q = self.q.tensors()
        cu_kv, cup_kv = (cu_q, cup_q) if self.kv_mode == "same" else self.kv.tensors()
        layout = VarlenLayout(cu_q, cu_kv, cup_q, cup_kv, max(self.q.lens), max(self.kv.lens))
        for rank in range(self.cp):
            yield PlanRequest(
                layout,
                self.options,
                cp_size=self.cp,
                cp_rank=rank,
                pad_between_seqs=self.pad,
                max_slot_q=max(self.q.slots) if self.max_slots else None,
                max_slot_kv=max(self.kv.slots) if self.max_slots else None,
                sinks=self.sinks,
                read_layout=self.read_layout,
            )


def _sees(n: int, m: int, diagonal: int, options: AttentionOptions) -> bool:
    """Whether query ``n`` (at key index ``n + diagonal``) sees key ``m``."""
    at = n + diagonal
    left, right = options.window_left, options.window_right
    return (left < 0 or m >= at - left) and (right < 0 or m <= at + right)


def _needed_pairs(call: Call) -> Counter[tuple[int, int]]:
    """Visible (global query row, global key row) pairs of the unsharded batch."""
    pairs: Counter[tuple[int, int]] = Counter()
    q0 = k0 = 0
    for lq, lk, sq, sk in zip(call.q.lens, call.kv.lens, call.q.slots, call.kv.slots, strict=True):
        for n in range(lq):
            pairs.update((q0 + n, k0 + m) for m in range(lk) if _sees(n, m, lk - lq, call.options))
        q0, k0 = q0 + sq, k0 + sk
    return pairs


def _launch_rows(launch: Launch) -> Iterator[tuple[list[int], list[int], int]]:
    """Per sequence of the launch: its local query rows, key rows, and key index of query 0."""
    layout = launch.layout
    cu_q, cu_kv = layout.cu_seqlens_q.tolist(), layout.cu_seqlens_kv.tolist()
    cup_q, cup_kv = layout.slots_q.tolist(), layout.slots_kv.tolist()
    pos_q = None if layout.positions_q is None else layout.positions_q.tolist()
    pos_kv = None if layout.positions_kv is None else layout.positions_kv.tolist()
    for s in range(len(cu_q) - 1):
        nq, nk = cu_q[s + 1] - cu_q[s], cu_kv[s + 1] - cu_kv[s]
        diagonal = nk - nq if pos_q is None or pos_kv is None else pos_q[s] - pos_kv[s]
        yield list(range(cup_q[s], cup_q[s] + nq)), list(range(cup_kv[s], cup_kv[s] + nk)), diagonal


def _launched(call: Call, plans: list[RingPlan]) -> tuple[Counter, Counter, set, set]:
    """``(visible pairs, sink rows, query rows read, key rows read)`` over every launch of every
    rank, in global rows."""
    pairs: Counter[tuple[int, int]] = Counter()
    sink_rows: Counter[int] = Counter()
    rows_q: set[int] = set()
    rows_kv: set[int] = set()
    for plan in plans:
        r = plan.cp_rank
        for j, step in enumerate(plan.steps):
            for launch in step:
                options = launch.launch_options(plan.options)
                for local_q, local_kv, diagonal in _launch_rows(launch):
                    gq = [call.q.global_row(call.cp, r, x) for x in local_q]
                    gk = [call.kv.global_row(call.cp, j, x) for x in local_kv]
                    rows_q.update(gq)
                    rows_kv.update(gk)
                    if launch.sinks:
                        sink_rows.update(gq)
                    for n, qrow in enumerate(gq):
                        pairs.update((qrow, gk[m]) for m in range(len(gk)) if _sees(n, m, diagonal, options))
    return pairs, sink_rows, rows_q, rows_kv


@st.composite
def _calls(draw: st.DrawFn) -> Call:
    cp = draw(st.integers(1, 3))
    num_seqs = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    kv_mode = draw(st.sampled_from(["same", "copy"] if causal else ["same", "copy", "cross", "cross"]))

    def side() -> Side:
        chunks = draw(st.lists(st.integers(1, 3), min_size=num_seqs, max_size=num_seqs))
        slots = tuple(2 * cp * c for c in chunks)
        return Side(tuple(draw(st.integers(0, s)) for s in slots), slots)

    q = side()
    kv = side() if kv_mode == "cross" else q
    sides = st.sampled_from([-1, 0, 1, 2, 3, 5, 8])
    bounded = draw(st.booleans())  # unbounded: the plain schedule
    left, right = (draw(sides), draw(sides)) if bounded else (-1, -1)
    right = min(right, 0) if causal else right
    options = AttentionOptions(0.5, causal, (left, right), draw(st.sampled_from([0.0, 2.0])))
    padded = any(n != s for side in (q, kv) for n, s in zip(side.lens, side.slots, strict=True))
    return Call(
        cp=cp,
        q=q,
        kv=kv,
        kv_mode=kv_mode,
        options=options,
        sinks=draw(st.booleans()),
        pad=padded or draw(st.booleans()),  # the cu // cp counts are exact only without padding
        read_layout=draw(st.booleans()),
        max_slots=draw(st.booleans()),
    )


_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _example(cp: int, q: Side, kv: Side, options: AttentionOptions, read_layout: bool) -> Call:
    kv_mode = "same" if kv == q else "cross"
    return Call(cp, q, kv, kv_mode, options, sinks=True, pad=True, read_layout=read_layout, max_slots=False)


_CROSS = _example(2, Side((3,), (8,)), Side((8,), (8,)), AttentionOptions(0.5, False, (1, 1)), False)
"""A short query against a long key sequence: the query chunks' positions are aligned."""
_NO_KEY = _example(2, Side((8,), (8,)), Side((2,), (8,)), AttentionOptions(0.5, False, (0, 0)), True)
"""Rank 0's first query chunk reaches no key: it still gets one launch, for the sink."""
_PLAIN = _example(3, Side((5, 12), (6, 12)), Side((5, 12), (6, 12)), AttentionOptions(0.5), True)
"""The plain non-causal schedule: the sink goes with one step only."""


@_SETTINGS
@given(call=_calls())
@example(call=_CROSS)
@example(call=_NO_KEY)
@example(call=_PLAIN)
def test_plan_launches_every_needed_pair_once(call: Call) -> None:
    """Over all ranks and steps, the launches make each visible pair of the unsharded mask visible
    exactly once and no other pair (so every skipped (query chunk, key chunk) pair is fully
    masked), read only real rows, and give each real query row the sink exactly once."""
    plans = [build_plan(request) for request in call.requests()]
    pairs, sink_rows, rows_q, rows_kv = _launched(call, plans)
    assert pairs == _needed_pairs(call), call
    assert all(call.q.is_real(x) for x in rows_q), (call, sorted(rows_q))
    assert all(call.kv.is_real(x) for x in rows_kv), (call, sorted(rows_kv))
    real_q = [x for x in range(sum(call.q.slots)) if call.q.is_real(x)]
    assert sink_rows == (Counter(real_q) if call.sinks else Counter()), call
    for plan in plans:
        assert plan.skipped == plan.pairs - plan.launches if plan.windowed else plan.skipped == 0
        assert len(plan.steps) == call.cp and plan.options.causal is False


@_SETTINGS
@given(call=_calls())
def test_plan_grid_bounds_cover_every_launch(call: Call) -> None:
    """With the largest slots known, or without padding, each launch's ``max_seqlen_*`` bounds the
    real rows of each of its sequences (a low bound would cost time only, so this is the tight case)."""
    if call.pad and not call.max_slots:
        call = Call(**{**call.__dict__, "max_slots": True})
    for plan in map(build_plan, call.requests()):
        for launch in (launch for step in plan.steps for launch in step):
            layout = launch.layout
            for cu, bound in (
                (layout.cu_seqlens_q, layout.max_seqlen_q),
                (layout.cu_seqlens_kv, layout.max_seqlen_kv),
            ):
                assert bound is not None and int((cu[1:] - cu[:-1]).max()) <= bound, (call, launch)


@_SETTINGS
@given(call=_calls())
@example(call=_NO_KEY)
@example(call=_PLAIN)
def test_plan_query_rows_hold_every_launch_query_rows(call: Call) -> None:
    """``query_rows`` (the rows of the backward's one shared ``rowsum(dO * out)``) are exactly the
    rank's real query rows, and hold the query rows of every launch of the rank; none at cp = 1."""
    if call.pad and not call.max_slots:
        call = Call(**{**call.__dict__, "max_slots": True})
    plans = [build_plan(request) for request in call.requests()]
    covered: set[int] = set()
    for plan in plans:
        if call.cp == 1:
            assert plan.query_rows is None
            continue
        assert plan.query_rows is not None
        rows: set[int] = set()
        for local_q, _, _ in _launch_rows(Launch(plan.query_rows, False)):
            rows.update(local_q)
        launches = [launch for step in plan.steps for launch in step]
        launched = {x for launch in launches for local_q, _, _ in _launch_rows(launch) for x in local_q}
        assert launched <= rows, (call, plan.cp_rank, sorted(launched - rows))
        covered.update(call.q.global_row(call.cp, plan.cp_rank, x) for x in rows)
        layout = plan.query_rows
        lengths = layout.cu_seqlens_q[1:] - layout.cu_seqlens_q[:-1]
        assert layout.max_seqlen_q is not None and int(lengths.max()) <= layout.max_seqlen_q, call
    if call.cp > 1:
        assert covered == {x for x in range(sum(call.q.slots)) if call.q.is_real(x)}, call


def _fingerprint(plan: RingPlan) -> list:
    def values(layout: VarlenLayout) -> list:
        return [None if t is None else t.tolist() for t in layout.tensors()] + [
            layout.max_seqlen_q,
            layout.max_seqlen_kv,
        ]

    steps = [[(values(x.layout), x.causal, x.sinks) for x in step] for step in plan.steps]
    return [plan.options, plan.windowed, plan.pairs, plan.skipped, steps]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=_calls())
def test_plan_is_deterministic(call: Call) -> None:
    """The same request twice gives the same launches, layouts and counters."""
    for request in call.requests():
        assert _fingerprint(build_plan(request)) == _fingerprint(build_plan(request))


def test_plan_needs_resolved_max_seqlens() -> None:
    cu = torch.tensor([0, 4], dtype=torch.int32)
    request = PlanRequest(
        VarlenLayout(cu, cu), AttentionOptions(1.0), cp_size=2, cp_rank=0, pad_between_seqs=False
    )
    with pytest.raises(ValueError, match=r"build_plan: layout max_seqlen_q/max_seqlen_kv: expected ints"):
        build_plan(request)


def test_plan_needs_no_process_group() -> None:
    """Planning needs no ``torch.distributed`` process group (none is initialised here)."""
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    cup = torch.tensor([0, 8, 16], dtype=torch.int32)
    plan = build_plan(
        PlanRequest(
            VarlenLayout(cu, cu, cup, cup, 7, 7),
            AttentionOptions(1.0, causal=True),
            cp_size=2,
            cp_rank=1,
            pad_between_seqs=True,
        )
    )
    assert [len(step) for step in plan.steps] == [1, 1] and not plan.windowed
