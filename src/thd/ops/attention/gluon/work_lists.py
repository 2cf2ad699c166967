"""The Gluon kernels' work lists, reused across calls on the same, unchanged offset tensors.

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

from collections.abc import Callable

import torch
from torch import Tensor

from thd._capture import is_capturing
from thd._runtime.tensor_keyed_cache import TensorKeyedCache
from thd.ops.attention.gluon.host import PlannedLaunch

__all__ = [
    "CAPACITY",
    "WorkList",
    "clear_work_lists",
    "planned_work_list",
    "work_list_launch",
    "work_list_counts",
    "work_list_for",
]

CAPACITY = 8
"""Work lists kept (least recently used first out)."""

WorkList = tuple[Tensor, Tensor, Tensor]
"""``(seq, blk, count)`` of ``schedule.build_work_list``."""

_LISTS: TensorKeyedCache[WorkList] = TensorKeyedCache(CAPACITY)

work_list_counts = _LISTS.counts
"""Calls of :func:`work_list_for` per outcome: ``"hits"``, ``"misses"``, ``"capturing"``,
``"uncached"``."""

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
    and equal ``sizes`` (the plan's rows, sequences, capacity, tile and order) built on the same stream
    (module docstring)."""
    return _LISTS.get_or_build((cu, slots), (_stream(cu), sizes), build, capturing=is_capturing())


def work_list_launch(
    *, num_seqs: int, num_rows: int, capacity: int, block_m: int, sequence_major: bool = False
) -> PlannedLaunch:
    """The planned launch of :func:`schedule.build_work_list` over ``num_seqs`` sequences of
    ``num_rows`` rows in all, in tiles of ``block_m`` rows, ``capacity`` items at most. Every
    constexpr is passed by keyword, so both families' plans state the list's order."""
    tile = {"BLOCK_M": block_m, "BLOCK_B": 64, "BLOCK_T": 32, "SEQUENCE_MAJOR": sequence_major}
    return PlannedLaunch((num_seqs,), (num_seqs, num_rows, capacity), {**tile, "num_warps": 4})


def planned_work_list(
    cu: Tensor, slots: Tensor, launch: PlannedLaunch, capacity: int, reused: bool
) -> WorkList:
    """``(seq, blk, count)`` of :func:`schedule.build_work_list` over the sequences of ``cu`` and
    ``slots`` in tiles of ``launch``'s ``BLOCK_M`` rows, in one int32 allocation of ``capacity``
    items, or the list an earlier call on the same, unchanged offsets built (:func:`work_list_for`).
    ``launch``: the builder's planned launch (:func:`work_list_launch`)."""
    from thd.ops.attention.gluon.schedule import build_work_list

    def build() -> WorkList:
        buffer = torch.empty(2 * capacity + 3, dtype=torch.int32, device=cu.device)
        seq, blk, count = buffer[:capacity], buffer[capacity : 2 * capacity], buffer[2 * capacity :]
        launch.run(build_work_list, (cu, slots, seq, blk, count), reused)
        return seq, blk, count

    order = bool(launch.keywords["SEQUENCE_MAJOR"])
    return work_list_for(cu, slots, (*launch.tail, launch.keywords["BLOCK_M"], order), build)


def clear_work_lists() -> None:
    """Forget every cached list (and the offset tensors it keeps alive) and reset the counts."""
    _LISTS.clear()
