"""Rank body of the document-aware CP tests (spawned by ``tests.cp._dist.spawn``, or run as threads).

Every rank builds the same global batch from a fixed seed (documents at slot offsets with
padding between them, poisoned with NaN), plans it with :func:`thd.cp.plan_documents`, runs
:func:`thd.cp.document_attention` on its buffer, forward and backward, and compares with
:func:`thd.reference.attention` on the global batch, gathered into the rank's buffer by the
plan's pieces (an index built here from ``plan.pieces``, not by the library).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import thd.reference
from tests._helpers import assert_close, assert_rows_equal, tolerance

__all__ = ["VARIANTS", "Batch", "batches", "check_rank", "make_inputs", "oracle", "worker"]

# (causal, window_size, softcap, sinks)
VARIANTS: tuple[tuple[bool, tuple[int, int], float, bool], ...] = (
    (True, (-1, -1), 0.0, False),
    (True, (5, 0), 2.0, True),
    (False, (-1, -1), 0.0, False),
    (False, (3, 4), 0.0, True),
)


@dataclass(frozen=True)
class Batch:
    """A global packed batch: document ``d`` at rows ``[offsets[d], offsets[d] + lengths[d])``."""

    name: str
    lengths: tuple[int, ...]
    pads: tuple[int, ...]
    ring_threshold: int | None = None
    spare: int = 0

    @property
    def offsets(self) -> list[int]:
        slots = [n + p for n, p in zip(self.lengths, self.pads, strict=True)]
        return [0, *accumulate(slots)][:-1]

    @property
    def rows(self) -> int:
        return sum(self.lengths) + sum(self.pads)

    def cu(self) -> tuple[Tensor, Tensor]:
        cu = torch.tensor([0, *accumulate(self.lengths)], dtype=torch.int32)
        cup = torch.tensor([*self.offsets, self.rows], dtype=torch.int32)
        return cu, cup

    def real(self) -> Tensor:
        mask = torch.zeros(self.rows, dtype=torch.bool)
        for o, n in zip(self.offsets, self.lengths, strict=True):
            mask[o : o + n] = True
        return mask


def batches(world: int, seed: int, count: int, *, scale: int = 1) -> list[Batch]:
    """Random batches for ``world`` ranks: short documents, empty ones, and at least one longer
    than a rank's share of the tokens (it must ride the ring)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        short = [
            rng.choice([0, 1, 2, rng.randint(3, 12 * scale), rng.randint(8, 30 * scale)])
            for _ in range(rng.randint(2, 3 * world))
        ]
        long = [rng.randint(sum(short) // world + 1, sum(short) // world + 40 * scale)] if i % 3 != 2 else []
        lengths = short + long
        rng.shuffle(lengths)
        pads = [rng.choice([0, 0, 1, 3]) for _ in lengths]
        threshold = rng.choice([None, None, 9 * scale])
        out.append(Batch(f"batch{i}", tuple(lengths), tuple(pads), threshold, spare=rng.choice([0, 3])))
    return out


def make_inputs(batch: Batch, heads: tuple[int, int, int, int], seed: int, device: str, dtype: torch.dtype):
    hq, hkv, d, dv = heads
    g = torch.Generator().manual_seed(seed)
    shapes = ((hq, d), (hkv, d), (hkv, dv), (hq, dv))
    tensors = [torch.randn(batch.rows, h, x, generator=g) for h, x in shapes]
    sinks = torch.randn(hq, generator=g)
    pad = ~batch.real()
    for t in tensors:
        t[pad] = float("nan")  # the global batch's padding is never read
    return [t.to(device, dtype) for t in tensors], sinks.to(device, dtype)


def oracle(
    batch: Batch,
    qkv: Sequence[Tensor],
    do: Tensor,
    sinks: Tensor | None,
    variant,
    attention: Callable[..., Any] | None = None,
) -> tuple[Tensor, ...]:
    """``(out, dq, dk, dv, dsinks, lse)`` of single-device attention on the global batch
    (:func:`thd.reference.attention` unless ``attention`` is given)."""
    causal, window, softcap, _ = variant
    cu, cup = (t.to(do.device) for t in batch.cu())
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    s = None if sinks is None else sinks.detach().clone().requires_grad_()
    longest = max(batch.lengths, default=0)
    out, lse = (attention or thd.reference.attention)(
        *leaves, cu, cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup, causal=causal,
        window_size=window, softcap=softcap, sinks=s, max_seqlen_q=longest, max_seqlen_kv=longest,
        return_lse=True,
    )  # fmt: skip
    real = batch.real().to(do.device)
    out.backward(torch.where(real[:, None, None], do, 0.0))
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return (out.detach(), *grads, None if s is None else s.grad, lse.detach())


def _gather_index(plan: Any, rank: int, offsets: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The rank's buffer as (global row, real) from ``plan.pieces`` alone (the contract)."""
    index = torch.zeros(plan.rows, dtype=torch.int64)
    real = torch.zeros(plan.rows, dtype=torch.bool)
    pieces = plan.pieces(rank)
    # buffer order: the ring pieces then the local documents; the rows of a ring piece follow
    # from its chunk (start // chunk) and the ring slots, the local ones are back to back
    ring = {d: i for i, d in enumerate(plan.ring_documents)}
    slot_start = [0, *accumulate(s // plan.cp_size for s in plan.ring_slots)]
    row = plan.ring_rows
    for doc, start, stop in pieces:
        if doc in ring:
            i = ring[doc]
            chunk = plan.ring_slots[i] // (2 * plan.cp_size)
            half = 0 if start // chunk == rank else 1
            at = slot_start[i] + half * chunk
        else:
            at, row = row, row + stop - start
        index[at : at + stop - start] = torch.arange(offsets[doc] + start, offsets[doc] + stop)
        real[at : at + stop - start] = True
    return index, real


def check_rank(
    rank: int,
    world: int,
    batch: Batch,
    variant,
    heads: tuple[int, int, int, int],
    *,
    device: str,
    dtype: torch.dtype,
    seed: int,
    attention: Callable[..., Tensor],
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, ...]:
    """One rank's forward and backward against the oracle; returns ``(out, dq, dk, dv)``."""
    from thd.cp import document_layout, partition_documents, plan_documents

    causal, window, softcap, with_sinks = variant
    label = f"{batch.name} {list(batch.lengths)} cp={world} rank={rank} variant={variant} heads={heads}"
    plan = plan_documents(batch.lengths, world, ring_threshold=batch.ring_threshold)
    if batch.spare:
        plan = plan_documents(
            batch.lengths, world, ring_threshold=batch.ring_threshold, capacity=plan.rows + batch.spare
        )
    layout = document_layout(plan, rank, device=device, offsets=batch.offsets)
    (q, k, v, do), sinks = make_inputs(batch, heads, seed, device, dtype)
    want = oracle(batch, (q, k, v), do, sinks if with_sinks else None, variant)
    index, real = _gather_index(plan, rank, batch.offsets)
    assert torch.equal(layout.index.cpu()[real], index[real]), (
        f"{label}: layout index differs from the pieces"
    )
    assert torch.equal(layout.valid.cpu(), real), f"{label}: layout rows differ from the pieces"
    mine = lambda t: torch.where(real.to(device).view(-1, 1, 1), t[index.to(device)], 0.0)

    def run(poison: bool) -> tuple[Tensor, ...]:
        shards = [partition_documents(t, layout) for t in (q, k, v, do)]
        if poison:
            for t in shards:
                t[~real.to(device)] = float("nan")
        leaves = [t.detach().clone().requires_grad_() for t in shards[:3]]
        s = sinks.detach().clone().requires_grad_() if with_sinks else None
        out, lse = attention(
            *leaves, layout, causal=causal, window_size=window, softcap=softcap, sinks=s, return_lse=True
        )
        out.backward(shards[3])
        ds = None if s is None else s.grad
        return (out.detach(), *(t.grad for t in leaves), ds, lse.detach())

    got = run(poison=False)
    names = ("out", "dq", "dk", "dv")
    for name, g, w in zip(names, got[:4], want[:4], strict=True):
        assert_close(g, mine(w), f"{label}: {name}", **tolerance(dtype, "grad" if name != "out" else "out"))
        assert_rows_equal(g, ~real.to(device), 0.0, f"{label}: {name} padding rows")
    want_lse = torch.where(real.to(device).view(1, -1), want[5][:, index.to(device)], float("-inf"))
    assert_close(got[5], want_lse, f"{label}: lse", **tolerance(torch.float32))
    if with_sinks and all_reduce is not None:
        assert_close(
            all_reduce(got[4].clone()),
            want[4],
            f"{label}: dsinks (summed over ranks)",
            **tolerance(dtype, "grad"),
        )
    again = run(poison=True)
    for name, g, a in zip((*names, "dsinks", "lse"), got, again, strict=True):
        assert g is None or torch.equal(g, a), (
            f"{label}: {name} changed when the buffer's padding rows hold NaN"
        )
    return got[:4]


def worker(
    rank: int, world: int, seed: int, count: int, variants: Sequence[int], check_unpartition: bool
) -> None:
    """Spawned rank: ``count`` random batches x the chosen variants, two head layouts (GQA)."""
    from thd.cp import document_attention, plan_documents, unpartition_documents

    group = dist.group.WORLD

    def reduce(t: Tensor) -> Tensor:
        dist.all_reduce(t, group=group)
        return t

    attention = lambda *a, **kw: document_attention(*a, group=group, **kw)
    for i, batch in enumerate(batches(world, seed, count)):
        for j in variants:
            heads = (4, 2, 8, 8) if (i + j) % 2 else (2, 2, 8, 16)
            got = check_rank(
                rank, world, batch, VARIANTS[j], heads, device="cpu", dtype=torch.float32,
                seed=seed + i, attention=attention, all_reduce=reduce,
            )  # fmt: skip
            if check_unpartition and j == variants[0] and not batch.spare:
                out = got[0]
                shards = [torch.empty_like(out) for _ in range(world)]
                dist.all_gather(shards, out.contiguous())
                plan = plan_documents(batch.lengths, world, ring_threshold=batch.ring_threshold)
                full = unpartition_documents(shards, plan, num_rows=batch.rows, offsets=batch.offsets)
                (q, k, v, do), sinks = make_inputs(batch, heads, seed + i, "cpu", torch.float32)
                want = oracle(batch, (q, k, v), do, sinks if VARIANTS[j][3] else None, VARIANTS[j])[0]
                real = batch.real()
                assert_close(
                    full[real], want[real], f"{batch.name} unpartitioned out", **tolerance(torch.float32)
                )
                assert_rows_equal(full, ~real, 0.0, f"{batch.name} unpartitioned padding rows")
