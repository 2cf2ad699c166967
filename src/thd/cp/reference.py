"""Single-process simulation of every rank of the ring: an oracle for the ring's schedule.

:func:`simulate_ring_attention` partitions a global batch, builds each rank's
:class:`~thd.cp.plan.RingPlan`, and runs every launch of every (rank, K/V block) step of the
forward and the backward with the same launch arguments as :mod:`thd.cp.ring` (layouts,
positions, skipped window pairs, the launches that carry the sinks), but without any
communication (the K/V block of rank ``j`` is read directly, and each block's dK/dV is summed
over all ranks). Each launch writes a fresh partial result and the partials are merged by
:func:`thd.ops.lse_merge.merge_partials` (the ring folds them in place instead), so the merge is
checked independently. It checks sections, per-launch counts, offsets and positions against
:func:`thd.reference.attention` on the unpartitioned batch without spawning processes. Not fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from thd.cp.launches import launch_backward, launch_forward
from thd.cp.partition import partition, unpartition
from thd.cp.plan import PlanRequest, RingPlan, build_plan
from thd.ops.attention.keywords import (
    SCORE_ARGS,
    ScoreArgs,
    Unpack,
    check_keywords,
    reference_options,
)
from thd.ops.attention.params import SavedForBackward, VarlenLayout
from thd.ops.lse_merge import merge_partials

__all__ = ["SimulatedRing", "simulate_ring_attention"]


@dataclass(frozen=True)
class SimulatedRing:
    """Per-rank shards (lists indexed by rank) and their unpartitioned global views."""

    out: list[Tensor]
    lse: list[Tensor]
    dq: list[Tensor] | None
    dk: list[Tensor] | None
    dv: list[Tensor] | None
    plans: list[RingPlan]
    dsinks: list[Tensor] | None = None
    """Per-rank parts of the sinks gradient (the ring returns these; their sum is the gradient)."""

    def gather(self, name: str, cu_seqlens_padded: Tensor) -> Tensor:
        """The global ``[T, ...]`` tensor of ``name`` (``out``, ``dq``, ``dk``, ``dv``)."""
        shards = getattr(self, name)
        return unpartition(shards, cu_seqlens_padded, len(shards))


def _max_len(cu: Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def simulate_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor,
    cu_seqlens_kv_padded: Tensor,
    *,
    cp_size: int,
    do: Tensor | None = None,
    pad_between_seqs: bool = True,
    read_layout: bool = True,
    **scores: Unpack[ScoreArgs],
) -> SimulatedRing:
    """Run the ring's per-rank launches for all ``cp_size`` ranks on the global ``q, k, v``.

    ``q, k, v`` and ``do`` (optional; enables the backward) are global ``[T, H, D]`` buffers
    laid out by ``cu_seqlens_*_padded``. ``read_layout`` is :class:`~thd.cp.plan.PlanRequest`'s
    (``True``: window pairs skipped from the layout's values, as on the validated path;
    ``False``: only those ruled out whatever the lengths, as under capture). Returns per-rank
    shards of ``out``, ``lse`` and, with ``do``, ``dq, dk, dv`` (and ``dsinks`` parts). The score
    keywords (``causal`` default True, ``softmax_scale``, ``window_size``, ``softcap``, ``sinks``)
    are :func:`thd.cp.ring_attention`'s.
    """
    check_keywords("simulate_ring_attention", scores, SCORE_ARGS)
    cp, sinks = cp_size, scores.get("sinks")
    layout = VarlenLayout(
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        max_seqlen_q=_max_len(cu_seqlens_q),
        max_seqlen_kv=_max_len(cu_seqlens_kv),
    )
    options = reference_options(q, scores, causal=True)
    plans = [
        build_plan(
            PlanRequest(
                layout,
                options,
                cp_size=cp,
                cp_rank=r,
                pad_between_seqs=pad_between_seqs,
                max_slot_q=_max_len(cu_seqlens_q_padded) if r % 2 else None,  # both bound paths
                max_slot_kv=_max_len(cu_seqlens_kv_padded) if r % 2 else None,
                sinks=sinks is not None,
                read_layout=read_layout,
            )
        )
        for r in range(cp)
    ]
    qs = [partition(q, cu_seqlens_q_padded, cp, r) for r in range(cp)]
    ks = [partition(k, cu_seqlens_kv_padded, cp, r) for r in range(cp)]
    vs = [partition(v, cu_seqlens_kv_padded, cp, r) for r in range(cp)]
    outs, lses = [], []
    for r, plan in enumerate(plans):
        parts = [
            launch_forward(launch, qs[r], ks[j], vs[j], plan.options, sinks)
            for j in ((r - i) % cp for i in range(cp))
            for launch in plan.steps[j]
        ]
        if not parts:  # a windowed plan with nothing to compute
            empty = qs[r].new_zeros(qs[r].shape[0], qs[r].shape[1], vs[r].shape[2])
            parts = [(empty, torch.full((q.shape[1], qs[r].shape[0]), float("-inf"), device=q.device))]
        out, lse = merge_partials(parts, q.dtype)
        outs.append(out)
        lses.append(lse)
    if do is None:
        return SimulatedRing(outs, lses, None, None, None, plans)
    dos = [partition(do, cu_seqlens_q_padded, cp, r) for r in range(cp)]
    dqs = [torch.zeros_like(x, dtype=torch.float32) for x in qs]
    dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
    dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
    dsinks = [torch.zeros(q.shape[1], dtype=torch.float32, device=q.device) for _ in range(cp)]
    for r, plan in enumerate(plans):
        for j in range(cp):
            for launch in plan.steps[j]:
                saved = SavedForBackward(qs[r], ks[j], vs[j], outs[r], lses[r], sinks)
                dq, dk, dv, ds = launch_backward(launch, dos[r], saved, plan.options)
                dqs[r] += dq
                dks[j] += dk
                dvs[j] += dv
                if ds is not None:
                    dsinks[r] += ds
    return SimulatedRing(
        outs,
        lses,
        [x.to(q.dtype) for x in dqs],
        [x.to(k.dtype) for x in dks],
        [x.to(v.dtype) for x in dvs],
        plans,
        None if sinks is None else [x.to(sinks.dtype) for x in dsinks],
    )
