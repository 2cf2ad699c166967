"""The Gluon forward's work lists, reused across calls on the same, unchanged offset tensors.

A work list (``schedule.build_work_list``) depends only on the values of the query offsets and
slot offsets and on the plan's sizes. A model passes one set of offsets to every attention layer,
so every layer after the first can skip the list's launch and allocation. The values cannot be
read on the host without a sync, so a call reuses a list only when its offsets are the very same
tensor objects, none written in place since (the same ``_version``; a write through ``.data`` or
outside torch is not seen, as for :mod:`thd.cp.plan_cache`'s plans), on the same stream (a list
built on one stream is not ordered with work on another).

Never under CUDA-graph capture: the graph must hold the list's own launch, so that a replay on new
offsets recomputes it. Offsets made under ``torch.inference_mode`` keep no version counter and
are never cached. The cache keeps the last :data:`CAPACITY` lists and their offset tensors (an
``id`` is never reused while cached).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from thd._capture import is_capturing

__all__ = ["CAPACITY", "WorkList", "clear_work_lists", "work_list_counts", "work_list_for"]

CAPACITY = 8
"""Work lists kept (least recently used first out)."""

WorkList = tuple[Tensor, Tensor, Tensor]
"""``(seq, blk, count)`` of ``schedule.build_work_list``."""

work_list_counts: Counter[str] = Counter()
"""Calls of :func:`work_list_for` per outcome: ``"hits"``, ``"misses"``, ``"capturing"``,
``"uncached"``."""

_lists: OrderedDict[tuple, tuple[tuple[Tensor, Tensor], WorkList]] = OrderedDict()
_lock = threading.Lock()  # ranks run as threads in some setups (and in the tests)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's driver reads


def _stream(t: Tensor) -> int:
    """The current stream's handle on ``t``'s device (0 on CPU)."""
    if not t.is_cuda:
        return 0
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(t.get_device()))
    return torch.cuda.current_stream(t.device).cuda_stream


def work_list_for(cu: Tensor, slots: Tensor, sizes: tuple, build: Callable[[], WorkList]) -> WorkList:
    """``build()``, or the list an earlier call with the same, unchanged ``cu`` and ``slots`` tensors
    and equal ``sizes`` (the plan's rows, sequences, capacity and tile) built (module docstring)."""
    if is_capturing():
        work_list_counts["capturing"] += 1
        return build()
    if cu.is_inference() or slots.is_inference():
        work_list_counts["uncached"] += 1
        return build()
    key = (id(cu), cu._version, id(slots), slots._version, _stream(cu), sizes)
    with _lock:
        entry = _lists.get(key)
        if entry is not None and entry[0][0] is cu and entry[0][1] is slots:
            _lists.move_to_end(key)
            work_list_counts["hits"] += 1
            return entry[1]
    result = build()
    with _lock:
        _lists[key] = ((cu, slots), result)
        if len(_lists) > CAPACITY:
            _lists.popitem(last=False)
        work_list_counts["misses"] += 1
    return result


def clear_work_lists() -> None:
    """Forget every cached list (and the offset tensors it keeps alive)."""
    with _lock:
        _lists.clear()
