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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from thd._capture import is_capturing
from thd.cp.checks import check_metadata, check_shards, check_values, max_len, resolve_max_seqlen
from thd.cp.comm import RingComm, resolve_group
from thd.cp.transport import ring_comm
from thd.errors import ThdError
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["RingPlan", "StepArgs", "build_plan", "path_counts", "ring_attention"]

path_counts: Counter[str] = Counter()
"""Calls per count path: ``"rank_counts"`` (exact, from :func:`thd.cp.rank_cu_seqlens`),
``"fast"`` (``cu_seqlens // cp``, only without padding) and ``"single"`` (cp = 1)."""

_FN = "ring_attention"
_KV, _DKV = 0, 1  # message kinds, part of the p2p tag


def _clean_padding(plan: RingPlan, out: Tensor | None = None, grads: tuple[Tensor, ...] = ()) -> None:
    """Exact zeros on the padding rows of ``out`` (query layout) and ``(dq, dk, dv)``; only
    when the layout has padding."""
    if not plan.pad:
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


def _tag(step: int, kind: int) -> int:
    """Base p2p tag of a step's message kind; the tensors of one message take ``base + index``."""
    return 4 * step + 2 * kind


@dataclass(frozen=True)
class StepArgs:
    """One ring step (one K/V source rank): its layout, and whether it is the causal diagonal."""

    layout: VarlenLayout
    causal: bool

    def _options(self, base: AttentionOptions) -> AttentionOptions:
        return replace(base, causal=self.causal)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        options: AttentionOptions,
        accumulate: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)``, zeros / ``-inf`` outside this step's rows;
        with ``accumulate`` this step is merged into that partial result in place instead."""
        from thd.ops.attention import attention_forward  # on use: keeps `import thd.cp` free of Triton

        return attention_forward(q, k, v, self.layout, self._options(options), accumulate=accumulate)

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, options: AttentionOptions
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of this step from the merged ``out`` and ``lse``."""
        from thd.ops.attention import attention_backward

        dq, dk, dv, _ = attention_backward(do, q, k, v, out, lse, self.layout, self._options(options))
        return dq, dk, dv


def _step(
    cu_q: Tensor, cu_kv: Tensor, cup_q: Tensor, cup_kv: Tensor, max_q: int, max_kv: int, causal: bool
) -> StepArgs:
    return StepArgs(VarlenLayout(cu_q, cu_kv, cup_q, cup_kv, max_q, max_kv), causal)


@dataclass(frozen=True)
class RingPlan:
    """Everything a rank needs for one call, built once by :func:`build_plan`.

    ``steps[j]`` are the kernel arguments for the K/V block of rank ``j``; ``cu_seqlens_*_local``
    are the real-row counts of this rank's own local slots and ``cu_seqlens_*_padded_local``
    their offsets (used for the padding cleanup).
    """

    cp_size: int
    cp_rank: int
    pad: bool
    exact: bool
    options: AttentionOptions
    steps: tuple[StepArgs, ...]
    cu_seqlens_q_local: Tensor
    cu_seqlens_q_padded_local: Tensor
    cu_seqlens_kv_local: Tensor
    cu_seqlens_kv_padded_local: Tensor


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
    """
    cu_q, cu_kv, cup_q, cup_kv = cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded
    cp, r = cp_size, cp_rank
    if cp == 1:
        step = _step(cu_q, cu_kv, cup_q, cup_kv, max_seqlen_q, max_seqlen_kv, causal)
        return RingPlan(
            1, 0, pad_between_seqs, True, AttentionOptions(softmax_scale), (step,), cu_q, cup_q, cu_kv, cup_kv
        )
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
    steps: list[StepArgs] = []
    if not causal:
        steps = [_step(full_q, tkv[j, 1:], cupl_q, cupl_kv, mq, mkv, False) for j in range(cp)]
    else:
        second_q, second_q_padded, kv_padded_shifted = tq[2 * cp + r], tq[3 * cp + 1], tkv[3 * cp]
        for j in range(cp):
            if j == r:
                steps.append(_step(full_q, full_q, cupl_q, cupl_kv, mq, mkv, True))
            elif j < r:
                steps.append(_step(full_q, tkv[cp + j, 1:], cupl_q, cupl_kv, mq, mkv_half, False))
            else:
                steps.append(_step(second_q, tkv[j], second_q_padded, kv_padded_shifted, mq_half, mkv, False))
    return RingPlan(
        cp,
        r,
        pad_between_seqs,
        exact,
        AttentionOptions(softmax_scale),
        tuple(steps),
        full_q,
        cupl_q,
        tkv[r, 1:],
        cupl_kv,
    )


def _exchange(
    comm: RingComm, tensors: Sequence[Tensor], offset: int, tag: int
) -> tuple[list[Tensor], list[dist.P2POp]]:
    """Receive buffers, and the ops that send ``tensors`` ``offset`` places on and receive the
    matching tensors from ``offset`` places back (tensor ``i`` travels with tag ``tag + i``)."""
    received = [torch.empty_like(t) for t in tensors]
    sends = [comm.send(t, offset, tag + i) for i, t in enumerate(tensors)]
    recvs = [comm.recv(t, -offset, tag + i) for i, t in enumerate(received)]
    return received, sends + recvs


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, plan: RingPlan, comm: RingComm, overlap: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, lse, k_last, v_last)``; ``*_last`` are the K/V of rank ``r + 1`` (start of the backward).

    The first step writes a fresh ``(out, lse)``; every later step folds its keys into it in
    place inside the attention kernel (no separate merge pass). With more than two steps the
    running result is kept in fp32 and rounded to ``q.dtype`` once at the end.
    """
    cp, r, options = plan.cp_size, plan.cp_rank, plan.options
    acc: tuple[Tensor, Tensor] | None = None
    for i in range(cp):
        j = (r - i) % cp
        pending = received = None
        if i + 1 < cp:  # post the next step's exchange before this step's compute
            received, ops = _exchange(comm, (k, v), +1, _tag(i + 1, _KV))
            pending = comm.start(ops)
            if not overlap:
                pending.wait()
        if acc is None:
            out, lse = plan.steps[j].forward(q, k, v, options)
            acc = (out.float() if cp > 2 else out), lse
        else:
            plan.steps[j].forward(q, k, v, options, accumulate=acc)
        if pending is not None and received is not None:
            pending.wait()
            k, v = received
    assert acc is not None
    out, lse = acc[0].to(q.dtype), acc[1]
    _clean_padding(plan, out)
    return out, lse, k, v


def _ring_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    plan: RingPlan,
    comm: RingComm,
    overlap: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reverse ring: at step ``i`` rank ``r`` holds K/V of rank ``(r + 1 + i) mod cp`` and the
    partial dK/dV of that block (summed over the ranks that held it before), adds its own part
    and passes both on; at the last step the block is its own and the gradient is complete."""
    cp, r, options = plan.cp_size, plan.cp_rank, plan.options
    dq_acc: Tensor | None = None
    dkv: tuple[Tensor, Tensor] | None = None
    for i in range(cp):
        j = (r + 1 + i) % cp
        ops: list[dist.P2POp] = []
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
        dq_i, dk_i, dv_i = plan.steps[j].backward(do, q, k, v, out, lse, options)
        if dq_acc is None:  # two parts: one add in q.dtype rounds exactly like an fp32 sum + cast
            dq_acc = dq_i if cp == 2 else dq_i.float()
        elif i + 1 == cp and dq_acc.dtype != q.dtype:  # last part: round once into q.dtype
            dq_acc = torch.add(dq_acc, dq_i, out=torch.empty_like(q))
        else:
            dq_acc.add_(dq_i)
        pending.wait()
        if dkv_in is None:
            dkv = (dk_i, dv_i)
        else:
            dkv_in[0].add_(dk_i)
            dkv_in[1].add_(dv_i)
            dkv = (dkv_in[0], dkv_in[1])
        if kv_next is not None:
            k, v = kv_next
    assert dq_acc is not None and dkv is not None
    dq = dq_acc.to(q.dtype)
    dk, dv = dkv
    _clean_padding(plan, grads=(dq, dk, dv))
    return dq, dk, dv


def _single_forward(q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> tuple[Tensor, Tensor]:
    out, lse = plan.steps[0].forward(q, k, v, plan.options)
    _clean_padding(plan, out)
    return out, lse


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the forward and reverse rings."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan, comm: RingComm, overlap: bool
    ) -> tuple[Tensor, Tensor]:
        if plan.cp_size == 1:
            out, lse = _single_forward(q, k, v, plan)
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            out, lse, k_last, v_last = _ring_forward(q, k, v, plan, comm, overlap)
            ctx.save_for_backward(q, k_last, v_last, out, lse)
        ctx.plan, ctx.comm, ctx.overlap = plan, comm, overlap  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is auxiliary and carries no gradient
        plan: RingPlan = ctx.plan  # type: ignore[attr-defined]
        dout = dout.contiguous()
        if plan.cp_size == 1:
            q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
            dq, dk, dv = plan.steps[0].backward(dout, q, k, v, out, lse, plan.options)
            _clean_padding(plan, grads=(dq, dk, dv))
        else:
            q, k_last, v_last, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
            dq, dk, dv = _ring_backward(dout, q, k_last, v_last, out, lse, plan, ctx.comm, ctx.overlap)  # type: ignore[attr-defined]
        return dq, dk, dv, None, None, None


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
            shapes that differ across ranks).

    Example (torchrun --nproc-per-node=2)::

        >>> cu = torch.tensor([0, 698, 1000], dtype=torch.int32, device="cuda")
        >>> cup = torch.tensor([0, 704, 1008], dtype=torch.int32, device="cuda")
        >>> q_r = thd.cp.partition(q, cup, cp, rank)  # likewise k, v
        >>> out_r = thd.cp.ring_attention(q_r, k_r, v_r, cu, cu, cup, cup, causal=True)
    """
    grp = resolve_group(_FN, group)
    comm = ring_comm(grp, q)  # the transport: chosen on the first call with grp, then cached
    cp = comm.size
    sync_ok = not is_capturing() and (
        q.device.type != "cuda" or max_seqlen_q is None or max_seqlen_kv is None
    )
    error: Exception | None = None
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
        softmax_scale=float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale),
        max_slot_q=max_len(cup_q) if sync_ok and pad and cp > 1 else None,
        max_slot_kv=max_len(cup_kv) if sync_ok and pad and cp > 1 else None,
    )
    path_counts["single" if cp == 1 else "rank_counts" if plan.exact else "fast"] += 1
    out, lse = RingAttentionFunction.apply(q, k, v, plan, comm, bool(_overlap))
    return (out, lse) if return_lse else out
