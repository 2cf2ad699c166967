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

Which launches each step runs is planned by :func:`thd.cp.plan.build_plan` (pure index math,
no process group; :func:`thd.cp.plan_cache.plan_for` reuses a plan across calls on the same,
unchanged layout tensors); this module runs the plan: the exchange loops, the autograd Function and the
public API.

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

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from thd._capture import is_capturing
from thd.cp.comm import P2P, RingComm, resolve_group
from thd.cp.launches import launch_backward, launch_forward, query_rows_delta
from thd.cp.plan import Launch, RingPlan
from thd.cp.prepare import RingCall, prepare_call
from thd.cp.transport import ring_comm
from thd.ops.attention.dispatch import runs_kernels
from thd.ops.attention.keywords import ScoreArgs, Unpack
from thd.ops.attention.params import AttentionOptions, SavedForBackward, VarlenLayout

__all__ = [
    "RingAttentionFunction",
    "path_counts",
    "ring_attention",
    "window_counts",
]

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


def _host_reads_allowed(q: Tensor, max_seqlen_q: int | None, max_seqlen_kv: int | None) -> bool:
    """Whether the call validates its layout and may read device memory: not under capture, and
    CPU tensors or a ``max_seqlen_*`` not given."""
    return not is_capturing() and (q.device.type != "cuda" or max_seqlen_q is None or max_seqlen_kv is None)


def _tag(step: int, kind: int) -> int:
    """Base p2p tag of a step's message kind; the tensors of one message take ``base + index``."""
    return 4 * step + 2 * kind


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
            out, lse = launch_forward(launch, q, k, v, options, sinks)
            acc = (out.float() if fp32 else out), lse
        else:
            launch_forward(launch, q, k, v, options, sinks, accumulate=acc)
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
    out, lse = acc  # an fp32 running result is rounded to q.dtype once
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    _clean_padding(plan, out)
    return out, lse, k, v


def _backward_step(
    launches: tuple[Launch, ...],
    do: Tensor,
    saved: SavedForBackward,
    options: AttentionOptions,
    dq_acc: Tensor | None = None,
    delta: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``(dq, dk, dv, dsinks)`` of one step (``None`` where no launch contributes). Plain
    schedule (one launch): its results as they are. Windowed (``dq_acc``, fp32): every launch
    adds its dQ into ``dq_acc`` and its dK/dV into one fp32 buffer each, rounded once to the
    input dtypes; ``dq`` is then ``dq_acc`` and ``dsinks`` the fp32 sum of the launches' parts."""
    if dq_acc is None:
        (launch,) = launches
        return launch_backward(launch, do, saved, options, delta=delta)
    if not launches:
        return None, None, None, None
    k, v = saved[1], saved[2]
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    dsinks = None
    for launch in launches:
        ds_i = launch_backward(launch, do, saved, options, accumulate=(dq_acc, dk, dv), delta=delta)[3]
        if ds_i is not None:
            dsinks = ds_i.float() if dsinks is None else dsinks.add_(ds_i)
    return dq_acc, dk.to(k.dtype), dv.to(v.dtype), dsinks


def _ring_backward(
    do: Tensor, saved: SavedForBackward, plan: RingPlan, comm: RingComm, overlap: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Reverse ring: at step ``i`` rank ``r`` holds K/V of rank ``(r + 1 + i) mod cp`` and the
    partial dK/dV of that block (summed over the ranks that held it before), adds its own part
    and passes both on; at the last step the block is its own and the gradient is complete.
    ``saved`` holds the K/V of rank ``r + 1``, where the reverse ring starts. ``dsinks`` is this
    rank's part (its real query rows), from the launches that carry sinks."""
    cp, r, options = plan.cp_size, plan.cp_rank, plan.options
    q, k, v, out, lse, sinks = saved
    # windowed: one fp32 dQ buffer every launch of every step adds into
    window_dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if plan.windowed else None
    dq_acc: Tensor | None = window_dq
    dsinks: Tensor | None = None
    dkv: tuple[Tensor, Tensor] | None = None
    delta = query_rows_delta(plan, do, saved)  # one preprocess for every step's launches
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
        step_saved = SavedForBackward(q, k, v, out, lse, sinks)
        dq_i, dk_i, dv_i, ds_i = _backward_step(plan.steps[j], do, step_saved, options, window_dq, delta)
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
        else:  # both partials in one call (one launch on the GPU)
            torch._foreach_add_([dkv_in[0], dkv_in[1]], [dk_i, dv_i])
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
    out, lse = launch_forward(plan.steps[0][0], q, k, v, plan.options, sinks)
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
        ctx.set_materialize_grads(False)  # no zero gradient is made for lse (nor for an unused out)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is auxiliary and carries no gradient
        plan: RingPlan = ctx.plan  # type: ignore[attr-defined]
        q, k, v, out, lse, sinks = ctx.saved_tensors  # type: ignore[attr-defined]
        if dout is None:  # an undefined gradient of out: zeros, as autograd would have made them
            dout = torch.zeros_like(out, memory_format=torch.contiguous_format)
        dout = dout.contiguous()
        if plan.cp_size == 1:
            (single,) = plan.steps[0]
            dq, dk, dv, dsinks = launch_backward(
                single, dout, SavedForBackward(q, k, v, out, lse, sinks), plan.options
            )
            _clean_padding(plan, grads=(dq, dk, dv))
        else:  # k, v: the K/V of rank r + 1, where the reverse ring starts
            saved = SavedForBackward(q, k, v, out, lse, sinks)
            dq, dk, dv, dsinks = _ring_backward(dout, saved, plan, ctx.comm, ctx.overlap)  # type: ignore[attr-defined]
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
    pad_between_seqs: bool | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    return_lse: bool = False,
    _overlap: bool = True,
    **scores: Unpack[ScoreArgs],
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
        causal: causal self-attention (default True; q and kv layouts must be identical); else
            every query sees every key of its sequence.
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
    given = VarlenLayout(
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv
    )  # as passed: checked by prepare_call
    sync_ok = _host_reads_allowed(q, max_seqlen_q, max_seqlen_kv)
    options, plan = prepare_call(RingCall(comm, (q, k, v), given, pad_between_seqs, scores), sync_ok=sync_ok)
    causal = scores.get("causal", True)
    sinks = scores.get("sinks")
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
