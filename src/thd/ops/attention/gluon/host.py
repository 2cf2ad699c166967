"""Host-side pieces both Gluon wrappers share: what the kernels take (dtypes, head dims, an sm_90
device), the argument groups of their launches (per-sequence tensors, strides) and their cached
launch plans (:class:`PlannedLaunch`, :class:`PlanTable`). The descriptors' scratch allocator is
:func:`thd._runtime.launcher.ensure_scratch_allocator`, shared with the tl kernels."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from thd._runtime.config import kernel_settings
from thd._runtime.launcher import launcher_for
from thd.ops.attention.gluon.compat import gluon_available
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "PlanTable",
    "PlannedLaunch",
    "device_index",
    "device_sms",
    "num_sms",
    "on_gluon_device",
    "row_strides",
    "same_dtype",
    "section_size",
    "sequence_args",
    "WarpSpecializedTile",
]

HEAD_DIMS = (64, 128)
"""Head dims both Gluon kernels take (the forward also takes 256)."""
DTYPES = (torch.bfloat16, torch.float16)
_INTERPRETING = kernel_settings().interpret  # read once, with the kernels (thd._runtime.config)


@dataclass(frozen=True)
class WarpSpecializedTile:
    """What the tiles of both Gluon kernels have: ``block_m`` query rows and ``block_n`` key rows
    per tile, and the register budgets of the one-warp TMA producer and of the second consumer
    partition (FA3's 24/240; the first consumer gets what is left). The budgets are keyword-only,
    so each kernel's tile lists its own fields positionally after the rows."""

    block_m: int
    block_n: int
    producer_regs: int = field(default=24, kw_only=True)
    consumer_regs: int = field(default=240, kw_only=True)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.cache
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def section_size(units: int, wanted: int) -> int:
    """Heads per section of a persistent kernel's work list of ``units`` heads (or head pairs): the
    largest divisor of ``units`` up to ``wanted``; ``units`` (one section) where ``wanted <= 0``."""
    wanted = units if wanted <= 0 else min(wanted, units)
    return max(d for d in range(1, wanted + 1) if units % d == 0)


def device_sms(t: Tensor) -> int:
    """The SMs of ``t``'s device: the persistent kernels' programs."""
    return num_sms(device_index(t.device))


def on_gluon_device(t: Tensor) -> bool:
    """Whether ``t`` lives on an sm_90 GPU and the installed Triton has Gluon's Hopper surface (the
    Triton interpreter runs no Gluon kernel: never under ``TRITON_INTERPRET``)."""
    return not _INTERPRETING and gluon_available() and t.is_cuda and _is_sm90(device_index(t.device))


def same_dtype(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``q, k, v`` share one of the kernels' 16-bit dtypes."""
    return q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype


def sequence_args(layout: VarlenLayout) -> tuple[bool, tuple[Tensor, ...]]:
    """``(HAS_POSITIONS, args)``: the kernels' per-sequence arguments in their order, ``cu_q, cu_kv,
    slots_q, slots_kv, pos_q, pos_kv`` (the offsets stand in, unread, for absent positions)."""
    if layout.positions_q is None or layout.positions_kv is None:
        has_positions, pos_q, pos_kv = False, layout.cu_seqlens_q, layout.cu_seqlens_kv
    else:
        has_positions, pos_q, pos_kv = True, layout.positions_q, layout.positions_kv
    offsets = (layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.slots_q, layout.slots_kv)
    return has_positions, (*offsets, pos_q, pos_kv)


def row_strides(*tensors: Tensor) -> tuple[int, ...]:
    """The row and head strides of each ``[T, H, D]`` tensor, in order: ``t.stride(0), t.stride(1)``."""
    return tuple(stride for t in tensors for stride in (t.stride(0), t.stride(1)))


class PlannedLaunch(NamedTuple):
    """One launch of a cached plan, everything but the call's tensors: the grid, the arguments after
    the tensors (sizes, strides, scores) and the keywords, fixed by the plan's key."""

    grid: tuple[int, ...]
    tail: tuple
    keywords: dict

    def run(self, kernel: Any, head: tuple, reused: bool) -> None:
        """Launch ``kernel`` with the call's tensors ``head`` first: by the plan's fixed parts when it
        served an earlier call (``reused``), else by the whole argument list (a plan seen once takes
        no record of the launcher's)."""
        if reused:
            launcher_for(kernel).run_fixed(self, self.grid, head, self.tail, self.keywords)
        else:
            launcher_for(kernel).run(self.grid, *head, *self.tail, **self.keywords)


class PlanTable:
    """A family's cached launch plans by key (the last :attr:`limit` kinds of call; a full table
    is cleared: a model makes a handful)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._plans: dict[tuple, Any] = {}

    def get(self, key: tuple) -> Any:
        return self._plans.get(key)

    def keep(self, key: tuple, plan: Any, options: AttentionOptions) -> None:
        """Keep ``plan`` for ``key``, unless the call's scale is zero: 0.0 and -0.0 are equal
        options but not one scale, so such a plan serves its own call only."""
        if options.softmax_scale == 0.0:
            return
        if len(self._plans) >= self.limit:
            self._plans.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def values(self) -> list[Any]:
        """The plans kept, oldest first."""
        return list(self._plans.values())

    def __len__(self) -> int:
        return len(self._plans)
