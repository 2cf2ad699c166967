"""Ring plans reused across calls on the same layout tensors (every layer of a training step).

A :class:`~thd.cp.plan.RingPlan` depends on the values of the layout's offset tensors, which the
host cannot read without a sync. So a call gets an earlier call's plan only when its layout
holds the very same tensor objects, none written in place since (the same ``_version``; a write
through ``.data`` or outside torch is not seen, as for :mod:`thd.padding`'s verdict cache), and
everything else in its :class:`~thd.cp.plan.PlanRequest` is equal. A model passes one set of
offsets to all its attention layers, so every layer after the first skips the plan's launches.

Never under CUDA-graph capture: a captured graph must hold the plan's own kernels, so that a
replay on new offsets (written into the captured tensors) recomputes it. The cache keeps the last
:data:`CAPACITY` plans and their layout tensors (an ``id`` is never reused while cached).
:data:`plan_cache_counts` counts ``"hits"``, ``"misses"``, ``"capturing"`` and ``"uncached"``
(layout tensors made under ``torch.inference_mode``, which keep no version counter): built, not
cached.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from operator import is_

from torch import Tensor

from thd._capture import is_capturing
from thd.cp.plan import PlanRequest, RingPlan, build_plan

__all__ = ["CAPACITY", "clear_plan_cache", "plan_cache_counts", "plan_for"]

CAPACITY = 8
"""Plans kept (least recently used first out)."""

plan_cache_counts: Counter[str] = Counter()
"""Calls of :func:`plan_for` per outcome: ``"hits"``, ``"misses"``, ``"capturing"``, ``"uncached"``."""

_plans: OrderedDict[tuple, tuple[tuple, RingPlan]] = OrderedDict()
_lock = threading.Lock()  # ranks run as threads in some setups (and in the tests)


def plan_for(request: PlanRequest) -> RingPlan:
    """:func:`~thd.cp.plan.build_plan` of ``request``, or the plan an earlier request on the same,
    unchanged layout tensors got (module docstring)."""
    if is_capturing():
        plan_cache_counts["capturing"] += 1
        return build_plan(request)
    layout = request.layout
    values = (
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.cu_seqlens_q_padded,
        layout.cu_seqlens_kv_padded,
        layout.max_seqlen_q,
        layout.max_seqlen_kv,
        layout.positions_q,
        layout.positions_kv,
    )
    tensors = tuple(v for v in values if isinstance(v, Tensor))
    try:
        versions = tuple((id(t), t._version) for t in tensors)
    except RuntimeError:  # an inference tensor: no version counter
        plan_cache_counts["uncached"] += 1
        return build_plan(request)
    key = (
        versions,
        layout.cu_seqlens_q_padded is None,
        layout.cu_seqlens_kv_padded is None,
        layout.max_seqlen_q,
        layout.max_seqlen_kv,
        layout.positions_q is None,
        request.options,
        request.cp_size,
        request.cp_rank,
        request.pad_between_seqs,
        request.max_slot_q,
        request.max_slot_kv,
        request.sinks,
        request.read_layout,
    )
    with _lock:
        entry = _plans.get(key)
        if entry is not None and all(map(is_, entry[0], tensors)):  # the key holds the rest by value
            _plans.move_to_end(key)
            plan_cache_counts["hits"] += 1
            return entry[1]
    plan = build_plan(request)
    with _lock:
        _plans[key] = (tensors, plan)
        if len(_plans) > CAPACITY:
            _plans.popitem(last=False)
        plan_cache_counts["misses"] += 1
    return plan


def clear_plan_cache() -> None:
    """Forget every cached plan (and the tensors they hold) and reset the counts."""
    with _lock:
        _plans.clear()
        plan_cache_counts.clear()
