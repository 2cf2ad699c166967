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

from torch import Tensor

from thd._capture import is_capturing
from thd._runtime.tensor_keyed_cache import TensorKeyedCache
from thd.cp.plan import PlanRequest, RingPlan, build_plan

__all__ = ["CAPACITY", "clear_plan_cache", "plan_cache_counts", "plan_for"]

CAPACITY = 8
"""Plans kept (least recently used first out)."""

_PLANS: TensorKeyedCache[RingPlan] = TensorKeyedCache(CAPACITY)

plan_cache_counts = _PLANS.counts
"""Calls of :func:`plan_for` per outcome: ``"hits"``, ``"misses"``, ``"capturing"``, ``"uncached"``."""


def plan_for(request: PlanRequest) -> RingPlan:
    """:func:`~thd.cp.plan.build_plan` of ``request``, or the plan an earlier request on the same,
    unchanged layout tensors got (module docstring)."""
    layout = request.layout
    values = (
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.cu_seqlens_q_padded,
        layout.cu_seqlens_kv_padded,
        layout.positions_q,
        layout.positions_kv,
    )
    rest = (  # by value; which optional tensors are given places the others
        layout.cu_seqlens_q_padded is None,
        layout.cu_seqlens_kv_padded is None,
        layout.max_seqlen_q,
        layout.max_seqlen_kv,
        layout.positions_q is None,
        layout.positions_kv is None,
        request.options,
        request.cp_size,
        request.cp_rank,
        request.pad_between_seqs,
        request.max_slot_q,
        request.max_slot_kv,
        request.sinks,
        request.read_layout,
    )
    tensors = tuple(v for v in values if isinstance(v, Tensor))
    return _PLANS.get_or_build(tensors, rest, lambda: build_plan(request), capturing=is_capturing())


def clear_plan_cache() -> None:
    """Forget every cached plan (and the tensors they hold) and reset the counts."""
    _PLANS.clear()
