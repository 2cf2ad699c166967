"""Document-aware CP planning on host lengths: short documents stay whole, long ones ride the ring.

:func:`plan_documents` places every document of a packed batch on the ``cp_size`` ranks of a
context-parallel group. A document either stays whole on one rank (a *local* document: plain
attention, no exchange) or is cut into ``2 * cp_size`` chunks in the ring's dual-chunk order
(chunks ``r`` and ``2 * cp_size - 1 - r`` on rank ``r``, as :func:`thd.cp.partition` does) and
rides the ring (a *ring* document). A document rides the ring when it is longer than a rank's
share of the tokens, when its cost alone exceeds a rank's share of the cost, when it is longer
than the caller's ``ring_threshold``, or when the local placement cannot otherwise reach the
balance ``tolerance`` or fit ``capacity``.

The balanced cost is :class:`CostModel`'s ``per_token * tokens + per_pair * causal pairs``
(linear layers scale with tokens, causal attention with the (query, key) pairs). Local documents
are placed by longest-processing-time first (the large ones through a heap, the small tail by
water-filling the remaining deficits), then refined by moves and swaps between the most and
least loaded ranks. Everything is numpy and plain Python on host integers, deterministic for
the same input (ties go to the lower document index and the lower rank).

Buffer of rank ``r`` (``plan.rows`` rows on every rank): first the ring region
(``plan.ring_rows`` rows: each ring document's local slot of ``2 * c_d`` rows, ``c_d = slot_d /
(2 * cp_size)``, every half a real prefix then padding), then the rank's local documents back
to back in document order, then padding up to ``plan.rows``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from thd.errors import ThdTypeError, ThdValueError
from thd.layout import check_cp

__all__ = ["LLAMA_8B_COST", "CostModel", "DocumentPlan", "plan_documents"]


@dataclass(frozen=True)
class CostModel:
    """Relative cost of a rank's work: ``per_token * tokens + per_pair * causal pairs``.

    Only the ratio matters. :meth:`for_model` derives both from a transformer layer's sizes
    (matmul FLOPs per token of the projections and MLP; ``4 * heads * head_dim`` FLOPs per
    attended (query, key) pair).
    """

    per_token: float
    per_pair: float

    def __post_init__(self) -> None:
        for name in ("per_token", "per_pair"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ThdValueError(f"CostModel: {name}: expected a finite number >= 0, got {value!r}")
        if self.per_token == 0 and self.per_pair == 0:
            raise ThdValueError("CostModel: per_token and per_pair: expected at least one > 0, got 0 and 0")

    @classmethod
    def for_model(
        cls,
        *,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        gated_mlp: bool = True,
    ) -> CostModel:
        """Cost of one decoder layer (forward FLOPs; the backward scales both terms alike)."""
        kv_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        mlp = 4 * hidden_size if intermediate_size is None else intermediate_size
        projections = 2 * hidden_size * dim * (2 * num_attention_heads + 2 * kv_heads)
        per_token = projections + 2 * hidden_size * mlp * (3 if gated_mlp else 2)
        return cls(per_token=float(per_token), per_pair=float(4 * num_attention_heads * dim))

    def of_documents(self, lengths: np.ndarray) -> np.ndarray:
        """Cost of each whole document (``L`` tokens, ``L (L + 1) / 2`` causal pairs)."""
        n = lengths.astype(np.float64)
        return self.per_token * n + self.per_pair * n * (n + 1.0) / 2.0


LLAMA_8B_COST = CostModel.for_model(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336
)
"""The default: a Llama-3-8B layer (a document's attention equals its linear layers at ~53k tokens)."""


@dataclass(frozen=True, eq=False)
class DocumentPlan:
    """Where every document of a batch goes on a CP group (see the module docstring).

    Public contract: :attr:`cp_size`, :attr:`ring_documents` and :meth:`pieces`; the other
    attributes describe the buffers (:attr:`rows`, :attr:`ring_rows`, :attr:`ring_slots`) and
    the balance (:attr:`rank_costs`, :attr:`rank_tokens`).
    """

    cp_size: int
    lengths: tuple[int, ...]
    ring_documents: tuple[int, ...]
    """Indices of the documents split across all ranks (ascending)."""
    ring_slots: tuple[int, ...]
    """Slot of each ring document: its length rounded up to a multiple of ``2 * cp_size``."""
    local_documents: tuple[tuple[int, ...], ...]
    """Per rank, the documents it holds whole (ascending; empty documents are nowhere)."""
    rows: int
    """Buffer rows of every rank."""
    rank_costs: tuple[float, ...]
    rank_tokens: tuple[int, ...]
    """Real tokens of each rank (local documents and its ring pieces)."""
    cost: CostModel

    @property
    def ring_rows(self) -> int:
        """Rows of every rank's ring region (``sum(ring_slots) // cp_size``)."""
        return sum(self.ring_slots) // self.cp_size

    @property
    def imbalance(self) -> float:
        """``max(rank_costs) / mean(rank_costs) - 1`` (0 for an empty batch)."""
        mean = sum(self.rank_costs) / self.cp_size
        return max(self.rank_costs) / mean - 1.0 if mean > 0 else 0.0

    def _check_rank(self, rank: int) -> None:
        check_cp("DocumentPlan.pieces", self.cp_size, rank)

    def piece_table(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(document, start, stop, buffer_row)`` int64 arrays of rank ``rank``'s non-empty
        pieces in buffer order: tokens ``[start, stop)`` of ``document`` sit at buffer rows
        ``[buffer_row, buffer_row + stop - start)``."""
        self._check_rank(rank)
        cp = self.cp_size
        docs = np.asarray(self.ring_documents, dtype=np.int64)
        lengths = np.asarray(self.lengths, dtype=np.int64)
        chunk = np.asarray(self.ring_slots, dtype=np.int64) // (2 * cp)
        length = lengths[docs]
        slot_start = np.concatenate(([0], np.cumsum(2 * chunk)[:-1])) if len(docs) else chunk
        first = np.clip(length - rank * chunk, 0, chunk)
        second = np.clip(length - (2 * cp - 1 - rank) * chunk, 0, chunk)
        ring_doc = np.stack((docs, docs), axis=1).reshape(-1)
        ring_start = np.stack((rank * chunk, (2 * cp - 1 - rank) * chunk), axis=1).reshape(-1)
        ring_count = np.stack((first, second), axis=1).reshape(-1)
        ring_row = np.stack((slot_start, slot_start + chunk), axis=1).reshape(-1)
        local = np.asarray(self.local_documents[rank], dtype=np.int64)
        local_len = lengths[local]
        local_row = self.ring_rows + np.concatenate(([0], np.cumsum(local_len)[:-1])) if len(local) else local
        doc = np.concatenate((ring_doc, local))
        start = np.concatenate((ring_start, np.zeros_like(local)))
        count = np.concatenate((ring_count, local_len))
        row = np.concatenate((ring_row, local_row))
        keep = count > 0
        return doc[keep], start[keep], start[keep] + count[keep], row[keep]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(document, start, stop)`` token ranges of rank ``rank`` in its buffer order, in each
        document's own coordinates; over all ranks every token of every document appears once."""
        doc, start, stop, _ = self.piece_table(rank)
        return list(zip(doc.tolist(), start.tolist(), stop.tolist(), strict=True))


def _lengths_array(lengths: object) -> np.ndarray:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (Sequence, np.ndarray)):
        raise ThdTypeError(
            f"plan_documents: lengths: expected a sequence of ints, got {type(lengths).__name__}"
        )
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ThdTypeError(
            "plan_documents: lengths: expected a flat sequence of ints, "
            f"got shape {arr.shape} dtype {arr.dtype}"
        )
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ThdValueError(f"plan_documents: lengths[{bad}] (={int(arr[bad])}): expected >= 0")
    return arr


def _ring_rank_costs(
    lengths: np.ndarray, slots: np.ndarray, cp: int, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Exact ``(cost, tokens)`` per rank of the ring documents (real rows of chunks ``r`` and
    ``2cp - 1 - r``; a query at position ``p`` of its document attends to ``p + 1`` keys)."""
    if lengths.size == 0:
        return np.zeros(cp), np.zeros(cp, dtype=np.int64)
    chunk = (slots // (2 * cp)).astype(np.float64)[None, :]
    n = lengths.astype(np.float64)[None, :]
    rank = np.arange(cp, dtype=np.float64)[:, None]
    pairs = np.zeros(cp)
    count = np.zeros(cp)
    for index in (rank, 2 * cp - 1 - rank):
        real = np.clip(n - index * chunk, 0.0, chunk)
        pairs += np.sum(real * index * chunk + real * (real + 1.0) / 2.0, axis=1)
        count += real.sum(axis=1)
    return cost.per_token * count + cost.per_pair * pairs, count.astype(np.int64)


_GOLDEN = 0.6180339887498949


def _water_fill(costs: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Rank of each small document (``costs`` sorted descending): fill the ranks up to a common
    level in rank order, each document going where the middle of its cost falls. The documents
    are taken in a golden-ratio interleaving of the sorted order, so every rank gets a similar
    mix of sizes (not the largest on rank 0 and the smallest on the last)."""
    perm = np.argsort(np.mod(np.arange(costs.shape[0]) * _GOLDEN, 1.0), kind="stable")
    owner = np.empty(costs.shape[0], dtype=np.int64)
    owner[perm] = _fill(costs[perm], loads)
    return owner


def _fill(costs: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """:func:`_water_fill` in the given order."""
    cp = loads.shape[0]
    total = float(costs.sum())
    order = np.sort(loads)
    level = order[-1] + (total - float(np.sum(order[-1] - order))) / cp
    for i in range(1, cp + 1):  # the lowest i ranks fill up to a level below the next one
        candidate = (total + float(order[:i].sum())) / i
        if i == cp or candidate <= order[i]:
            level = candidate
            break
    deficit = np.maximum(level - loads, 0.0)
    bounds = np.cumsum(deficit)
    middle = np.cumsum(costs) - costs / 2.0
    return np.minimum(np.searchsorted(bounds, middle, side="right"), cp - 1)


def _place(costs: np.ndarray, loads: np.ndarray, small: float) -> np.ndarray:
    """LPT rank of each document (``costs`` sorted descending): a heap for those above
    ``small``, water-filling for the rest. ``loads`` (per rank) is updated in place."""
    owner = np.empty(costs.shape[0], dtype=np.int64)
    big = int(np.searchsorted(-costs, -small, side="left"))  # costs[:big] > small
    heap = [(float(load), r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    for i, c in enumerate(costs[:big].tolist()):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + c, r))
    for load, r in heap:
        loads[r] = load
    if big < costs.shape[0]:
        owner[big:] = _water_fill(costs[big:], loads)
        np.add.at(loads, owner[big:], costs[big:])
    return owner


def _refine(costs: np.ndarray, owner: np.ndarray, loads: np.ndarray, rounds: int, good: float) -> None:
    """Moves and swaps between the most and least loaded ranks while they lower the maximum
    (until it is at most ``good``)."""
    for _ in range(rounds):
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        if gap <= 0 or loads[hi] <= good:
            return
        on_hi = np.flatnonzero(owner == hi)
        on_lo = np.flatnonzero(owner == lo)
        best, best_delta, move = None, 0.0, None
        x = costs[on_hi]
        ok = (x > 0) & (x < gap)  # a move of x lowers the pair's maximum
        if ok.any():
            i = int(np.argmin(np.where(ok, np.abs(x - gap / 2), np.inf)))
            best_delta, move = float(x[i]), (int(on_hi[i]), None)
            best = abs(best_delta - gap / 2)
        if on_lo.size and on_hi.size:
            y_order = np.argsort(costs[on_lo], kind="stable")
            y = costs[on_lo][y_order]
            want = x - gap / 2
            pos = np.clip(np.searchsorted(y, want), 0, y.size - 1)
            for candidate in (pos, np.maximum(pos - 1, 0)):
                delta = x - y[candidate]
                ok = (delta > 0) & (delta < gap)
                if ok.any():
                    score = np.where(ok, np.abs(delta - gap / 2), np.inf)
                    i = int(np.argmin(score))
                    if best is None or score[i] < best:
                        best, best_delta = float(score[i]), float(delta[i])
                        move = (int(on_hi[i]), int(on_lo[y_order[candidate[i]]]))
        if move is None:
            return
        owner[move[0]] = lo
        if move[1] is not None:
            owner[move[1]] = hi
        loads[hi] -= best_delta
        loads[lo] += best_delta


@dataclass(frozen=True)
class _Placement:
    """One outcome of :meth:`_Search.run`: the ring documents and the owner of every other."""

    ring_idx: np.ndarray
    slots: np.ndarray
    ring_rows: int
    ring_tokens: np.ndarray
    owner: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray

    @property
    def rows(self) -> int:
        """Rows per rank the placement needs."""
        return self.ring_rows + (int(self.tokens.max()) if self.tokens.size else 0)


@dataclass(frozen=True)
class _Search:
    """Places the local documents, moving documents to the ring until the balance and the
    capacity (when given) hold."""

    lens: np.ndarray
    doc_cost: np.ndarray
    cp: int
    cost: CostModel
    tolerance: float

    def place(self, ring: np.ndarray) -> _Placement:
        """LPT placement plus refinement of the documents not in ``ring``."""
        lens, cp, tolerance = self.lens, self.cp, self.tolerance
        ring_idx = np.flatnonzero(ring)
        slots = -(-lens[ring_idx] // (2 * cp)) * (2 * cp)
        loads, ring_tokens = _ring_rank_costs(lens[ring_idx], slots, cp, self.cost)
        local = np.flatnonzero((lens > 0) & ~ring)
        order = local[np.argsort(-self.doc_cost[local], kind="stable")]
        costs = self.doc_cost[order]
        mean = (loads.sum() + costs.sum()) / cp
        owner = np.full(lens.shape[0], -1, dtype=np.int64)
        if order.size:
            assigned = _place(costs, loads, small=tolerance * mean / 4)
            _refine(costs, assigned, loads, rounds=4 * cp, good=(1.0 + tolerance / 4) * mean)
            owner[order] = assigned
        tokens = np.bincount(owner[order], weights=lens[order], minlength=cp).astype(np.int64)
        return _Placement(
            ring_idx=ring_idx,
            slots=slots,
            ring_rows=int(slots.sum()) // cp,
            ring_tokens=ring_tokens,
            owner=owner,
            loads=loads,
            tokens=tokens,
        )

    def run(self, ring: np.ndarray, capacity: int | None) -> _Placement:
        """Moves one document at a time to the ring (``ring`` is updated) until the placement
        fits ``capacity`` and is balanced, or no document of the offending rank is left."""
        fn, lens, cp = "plan_documents", self.lens, self.cp
        while True:
            found = self.place(ring)
            if capacity is not None and found.ring_rows > capacity:
                raise ThdValueError(
                    f"{fn}: capacity (={capacity}): expected at least the {found.ring_rows} ring rows "
                    f"per rank of documents that cannot stay whole (lengths total {int(lens.sum())}, "
                    f"cp_size {cp})"
                )
            over = (
                np.flatnonzero(found.tokens + found.ring_rows > capacity)
                if capacity is not None
                else np.empty(0, np.int64)
            )
            loads = found.loads
            mean = loads.sum() / cp
            worst = int(np.argmax(loads))
            unbalanced = mean > 0 and loads[worst] > (1.0 + self.tolerance) * mean
            culprit = int(over[0]) if over.size else (worst if unbalanced else -1)
            local = np.flatnonzero(found.owner == culprit) if culprit >= 0 else np.empty(0, np.int64)
            candidates = local[np.argsort(-self.doc_cost[local], kind="stable")]
            if not candidates.size:
                if over.size:
                    raise ThdValueError(
                        f"{fn}: capacity (={capacity}): rank {culprit} needs "
                        f"{int(found.tokens[culprit]) + found.ring_rows} rows "
                        f"(lengths total {int(lens.sum())}, cp_size {cp})"
                    )
                return found
            if over.size:  # the shortest document whose spreading brings the rank under capacity
                excess = int(found.tokens[culprit]) + found.ring_rows - capacity
                slot_rows = -(-lens[candidates] // (2 * cp)) * 2
                relief = lens[candidates] - slot_rows
                enough = candidates[relief >= excess]
                ring[enough[-1] if enough.size else candidates[int(np.argmax(relief))]] = True
            else:  # the cheapest document whose spreading removes the excess, else the costliest
                need = (loads[worst] - mean) * cp / max(cp - 1, 1)
                enough = candidates[self.doc_cost[candidates] >= need]
                ring[enough[-1] if enough.size else candidates[0]] = True


def plan_documents(
    lengths: Sequence[int] | np.ndarray,
    cp_size: int,
    *,
    cost: CostModel = LLAMA_8B_COST,
    ring_threshold: int | None = None,
    capacity: int | None = None,
    tolerance: float = 0.02,
) -> DocumentPlan:
    """Place the documents of one packed batch on ``cp_size`` ranks (host only, deterministic).

    Args:
        lengths: real length of every document (host ints, e.g. from the data loader).
        cp_size: ranks of the CP group.
        cost: what is balanced (:class:`CostModel`; default a Llama-3-8B layer).
        ring_threshold: documents longer than this always ride the ring (``0``: every
            non-empty document does, which is the uniform ring).
        capacity: rows of every rank's buffer (e.g. a fixed buffer under CUDA graphs); by
            default the least that holds the plan. Documents that do not fit ride the ring.
        tolerance: allowed ``max(rank cost) / mean - 1`` before documents are moved to the ring.

    Returns:
        :class:`DocumentPlan`.

    Raises:
        ThdTypeError / ThdValueError: lengths not a flat sequence of ints >= 0, a bad
            ``cp_size``, ``ring_threshold``, ``tolerance`` or a ``capacity`` too small for the batch.
    """
    fn = "plan_documents"
    lens = _lengths_array(lengths)
    check_cp(fn, cp_size)
    if not isinstance(cost, CostModel):
        raise ThdTypeError(f"{fn}: cost: expected a CostModel, got {type(cost).__name__}")
    for name, value in (("ring_threshold", ring_threshold), ("capacity", capacity)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ThdValueError(f"{fn}: {name}: expected None or an int >= 0, got {value!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ThdValueError(f"{fn}: tolerance: expected a number >= 0, got {tolerance!r}")
    cp = cp_size
    doc_cost = cost.of_documents(lens)
    nonempty = lens > 0
    ring = np.zeros(lens.shape[0], dtype=bool)
    if cp > 1:
        share_tokens = lens.sum() / cp
        ring |= nonempty & ((lens > share_tokens) | (doc_cost > doc_cost.sum() / cp))
        if ring_threshold is not None:
            ring |= nonempty & (lens > ring_threshold)
    search = _Search(lens=lens, doc_cost=doc_cost, cp=cp, cost=cost, tolerance=float(tolerance))
    found = search.run(ring=ring.copy(), capacity=None)
    if capacity is not None and found.rows > capacity:  # the capacity binds: plan again under it
        found = search.run(ring=ring, capacity=capacity)
    rows = found.rows if capacity is None else capacity
    owner, loads = found.owner, found.loads
    locals_ = tuple(tuple(np.flatnonzero(owner == r).tolist()) for r in range(cp))
    return DocumentPlan(
        cp_size=cp,
        lengths=tuple(lens.tolist()),
        ring_documents=tuple(found.ring_idx.tolist()),
        ring_slots=tuple(found.slots.tolist()),
        local_documents=locals_,
        rows=rows,
        rank_costs=tuple(loads.tolist()),
        rank_tokens=tuple((found.tokens + found.ring_tokens).tolist()),
        cost=cost,
    )
