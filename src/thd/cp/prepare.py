"""What :func:`thd.cp.ring_attention` derives from its arguments before any launch: the checked
score options and the ring plan (:class:`PreparedCall`).

Where the call may not read device memory (CUDA tensors with ``max_seqlen_*`` given, or a CUDA-graph
capture), the checks are host-only and the plan depends on the layout tensors' identities (see
:mod:`thd.cp.plan_cache`), so a repeat call (every layer after the first of a training step) gets
the earlier call's result when it passes the same, unchanged layout tensors, shards and sinks of the
same shapes, strides, dtypes and devices, and equal other arguments: its checks would pass as
theirs did and its plan would be theirs. Where host reads are allowed, the checks include a
collective and value reads, and every call runs them (a rank that skipped a collective another
rank ran would hang the group). :data:`prepare_counts` counts the repeat cache's outcomes.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from thd._capture import is_capturing
from thd._runtime.tensor_keyed_cache import TensorKeyedCache
from thd.cp.checks import (
    check_metadata,
    check_scores,
    check_shards,
    check_values,
    max_len,
    resolve_max_seqlen,
)
from thd.cp.comm import RingComm
from thd.cp.plan import PlanRequest, RingPlan
from thd.cp.plan_cache import plan_for
from thd.errors import ThdError
from thd.ops.attention.keywords import SCORE_ARGS, ScoreArgs, check_keywords
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["CAPACITY", "PreparedCall", "RingCall", "clear_prepared_calls", "prepare_call", "prepare_counts"]

_FN = "ring_attention"

CAPACITY = 8
"""Prepared calls kept (least recently used first out)."""

_CALLS: TensorKeyedCache[PreparedCall] = TensorKeyedCache(CAPACITY)

prepare_counts = _CALLS.counts
"""Repeat-cache outcomes of calls that may not read device memory: ``"hits"``, ``"misses"``,
``"capturing"``, ``"uncached"`` (inference tensors, or unhashable score arguments)."""


class RingCall(NamedTuple):
    """A ring call's arguments as passed: the transport, this rank's ``(q, k, v)`` shards, the GLOBAL
    layout (unchecked), ``pad_between_seqs`` and the score keywords."""

    comm: RingComm
    shards: tuple[Tensor, Tensor, Tensor]
    given: VarlenLayout
    pad_between_seqs: bool | None
    scores: ScoreArgs


class PreparedCall(NamedTuple):
    """The call's score options (scale resolved) and its ring plan."""

    options: AttentionOptions
    plan: RingPlan


def _resolve_pad(explicit: bool | None, cu: Tensor, cup: Tensor | None, cp: int) -> bool:
    from thd.padding import resolve_pad_between_seqs  # imported on use: thd.padding imports Triton

    return resolve_pad_between_seqs(explicit, cu, cup, cp_size=cp)


def _checked(call: RingCall, sync_ok: bool) -> PreparedCall:
    """Every check of the call, then its plan (the checks' order and errors as documented by
    :func:`thd.cp.ring_attention`)."""
    comm, (q, k, v), given, pad_between_seqs, scores = call
    cp = comm.size
    error: Exception | None = None
    options = AttentionOptions(1.0)
    causal = scores.get("causal", True)
    try:
        check_keywords(_FN, scores, SCORE_ARGS)
        check_metadata(q, k, v, given, causal)
        options = check_scores(q, scores)
    except ThdError as exc:
        error = exc
    if sync_ok and cp > 1:
        check_shards(comm, q, k, v, error)
    elif error is not None:
        raise error
    if sync_ok:
        check_values(given, cp, q.shape[0], k.shape[0], causal)
    cup_q, cup_kv = given.slots_q, given.slots_kv
    pad = _resolve_pad(pad_between_seqs, given.cu_seqlens_q, given.cu_seqlens_q_padded, cp)
    if pad_between_seqs is None and not pad:
        pad = _resolve_pad(None, given.cu_seqlens_kv, given.cu_seqlens_kv_padded, cp)
    max_slots = sync_ok and pad and cp > 1  # the largest slots tighten the grid bounds: one read each
    layout = given.with_max_seqlens(
        resolve_max_seqlen("max_seqlen_q", given.cu_seqlens_q, given.max_seqlen_q),
        resolve_max_seqlen("max_seqlen_kv", given.cu_seqlens_kv, given.max_seqlen_kv),
    )
    request = PlanRequest(
        layout,
        options,
        cp_size=cp,
        cp_rank=comm.rank,
        pad_between_seqs=pad,
        max_slot_q=max_len(cup_q) if max_slots else None,
        max_slot_kv=max_len(cup_kv) if max_slots else None,
        sinks=scores.get("sinks") is not None,
        read_layout=sync_ok,
    )
    return PreparedCall(options, plan_for(request))


def _meta(t: Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def prepare_call(call: RingCall, *, sync_ok: bool) -> PreparedCall:
    """The checked options and plan of ``call``; ``sync_ok``: whether the call may read device
    memory (then every check runs, collectives included). Raises what the checks raise."""
    if sync_ok:
        return _checked(call, sync_ok=True)
    given, scores = call.given, call.scores
    tensors = tuple(t for t in given.tensors()[:4] if t is not None)
    rest = (
        call.comm,
        *map(_meta, call.shards),
        _meta(scores.get("sinks")),
        tuple((name, value) for name, value in scores.items() if name != "sinks"),
        given.cu_seqlens_q_padded is None,
        given.cu_seqlens_kv_padded is None,
        given.max_seqlen_q,
        given.max_seqlen_kv,
        call.pad_between_seqs,
    )
    # an unhashable score argument is not cached (its checks will say whether it is valid)
    return _CALLS.get_or_build(tensors, rest, lambda: _checked(call, sync_ok=False), capturing=is_capturing())


def clear_prepared_calls() -> None:
    """Forget every prepared call (and the tensors it holds) and reset the counts."""
    _CALLS.clear()
