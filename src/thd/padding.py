"""Padding detection with a capture-safe verdict cache, valid-row masks and padding zeroing.

"Is there padding between sequences?" (``pad_between_seqs``) decides which kernels and which
per-rank counts are exact. :func:`detect_pad_between_seqs` answers it by value in eager mode
(one small device-to-host copy) and caches the verdict under a key that proves identity and
freshness: weak references to both tensors (a reused ``id()`` never hits and no tensor is kept
alive), their ``_version`` counters (in-place refills invalidate), data pointers, shapes,
dtypes, devices and ``cp_size``. During CUDA-graph capture a hit reuses the eager verdict and a
miss returns the safe answer ``True`` without reading device memory. Warm-up iterations run
eagerly and fill the cache.

Limits of the freshness key: writes that bypass autograd's version counter (``.data``, raw
kernels, NCCL receives into the buffer, graph replays) are invisible; pass ``pad_between_seqs``
explicitly (it always wins, see :func:`resolve_pad_between_seqs`) when buffers change that way.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from thd import _capture
from thd.errors import ThdTypeError
from thd.layout import check_cp, check_cu_metadata, check_num_rows
from thd.ops.zero_padding import interface as _op
from thd.ops.zero_padding.reference import valid_row_mask

__all__ = [
    "clear_detection_cache",
    "detect_pad_between_seqs",
    "detection_stats",
    "resolve_pad_between_seqs",
    "valid_rows",
    "zero_padding_",
]

DETECTION_CACHE_SIZE = 1024
"""Most verdicts kept (least recently used evicted first)."""


@dataclass(frozen=True)
class _Verdict:
    cu_ref: weakref.ReferenceType[Tensor]
    cup_ref: weakref.ReferenceType[Tensor]
    state: tuple[object, ...]
    value: bool


_cache: OrderedDict[tuple[int, int, int], _Verdict] = OrderedDict()
_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0, "fallbacks": 0}


def _state(cu: Tensor, cup: Tensor) -> tuple[object, ...]:
    # Host-only attributes: never touches device memory.
    return (
        cu._version,
        cup._version,
        cu.data_ptr(),
        cup.data_ptr(),
        cu.shape,
        cup.shape,
        cu.dtype,
        cup.dtype,
        cu.device,
        cup.device,
    )


def _compare(cu: Tensor, cup: Tensor, cp_size: int) -> bool:
    """Spec §4.3, by value; one device-to-host copy of a single bool."""
    differs = cu != cup
    num_seqs = cu.shape[0] - 1
    if cp_size == 1 or num_seqs == 0:
        # Without CP only slot starts and all but the last length matter: cu[:-1] vs cup[:-1].
        return bool((differs if cp_size > 1 else differs[:-1]).any())
    # Under CP every entry matters, except trailing sequences with no real rows.
    has_rows = (cu[1:] - cu[:-1]) != 0
    limit = (torch.arange(1, num_seqs + 1, device=cu.device) * has_rows).amax()
    relevant = torch.arange(num_seqs + 1, device=cu.device) <= limit
    return bool((differs & relevant).any())


def detect_pad_between_seqs(
    cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, *, cp_size: int = 1
) -> bool:
    """Whether the layout has padding that kernels must treat as such (spec §4.3).

    - ``cu_seqlens_padded`` is ``None`` or the same object as ``cu_seqlens``: ``False``.
    - ``cp_size == 1``: ``True`` iff ``cu_seqlens[:-1] != cu_seqlens_padded[:-1]`` anywhere
      (tail padding and reserved capacity are benign for the kernels).
    - ``cp_size > 1``: ``True`` iff the tensors differ anywhere, except after the last
      sequence with real rows (trailing zero-length placeholders are benign). Tail padding of
      a real last sequence counts.

    Eager calls compare values (one small device-to-host copy) and cache the verdict; cache
    hits cost a few microseconds of host time. During CUDA-graph capture a hit reuses the
    cached verdict and a miss returns ``True`` (safe, possibly slower) without reading device
    memory; meta tensors (no values) also get ``True``. See :func:`detection_stats` and
    :func:`clear_detection_cache`.
    """
    if cu_seqlens_padded is None or cu_seqlens_padded is cu_seqlens:
        return False
    key = (id(cu_seqlens), id(cu_seqlens_padded), cp_size)
    entry = _cache.get(key)
    if (
        entry is not None
        and entry.cu_ref() is cu_seqlens
        and entry.cup_ref() is cu_seqlens_padded
        and entry.state == _state(cu_seqlens, cu_seqlens_padded)
    ):
        with _lock:
            _stats["hits"] += 1
            if key in _cache:
                _cache.move_to_end(key)
        return entry.value
    fn = "detect_pad_between_seqs"
    check_cu_metadata(fn, cu_seqlens, cu_seqlens_padded)
    check_cp(fn, cp_size)
    if _capture.is_capturing() or cu_seqlens.is_meta:
        with _lock:
            _stats["fallbacks"] += 1
        return True
    value = _compare(cu_seqlens, cu_seqlens_padded, cp_size)
    verdict = _Verdict(
        weakref.ref(cu_seqlens), weakref.ref(cu_seqlens_padded), _state(cu_seqlens, cu_seqlens_padded), value
    )
    with _lock:
        _stats["misses"] += 1
        _cache[key] = verdict
        _cache.move_to_end(key)
        while len(_cache) > DETECTION_CACHE_SIZE:
            _cache.popitem(last=False)
    return value


def resolve_pad_between_seqs(
    explicit: bool | None, cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, *, cp_size: int = 1
) -> bool:
    """``explicit`` if given (the caller's promise always wins), else :func:`detect_pad_between_seqs`."""
    if explicit is None:
        return detect_pad_between_seqs(cu_seqlens, cu_seqlens_padded, cp_size=cp_size)
    _check_pad_flag("resolve_pad_between_seqs", explicit)
    return explicit


def _check_pad_flag(fn: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ThdTypeError(f"{fn}: pad_between_seqs: expected a bool or None, got {type(value).__name__}")


def zero_padding_(
    x: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor | None = None,
    *,
    pad_between_seqs: bool | None = None,
    valid_end: int | None = None,
) -> Tensor:
    """Zero every padding row of ``x`` in place and return ``x``.

    The op :func:`thd.ops.zero_padding.zero_padding_` (see it for ``x``, the layout and
    ``valid_end``) with detection: ``pad_between_seqs=None`` resolves it with
    :func:`detect_pad_between_seqs` (``cp_size=1``; ``True`` on a cache miss during capture).
    An explicit value always wins. Capture-safe: no host sync.
    """
    fn = "zero_padding_"
    _op.check_args(fn, x, cu_seqlens, cu_seqlens_padded, valid_end)
    _check_pad_flag(fn, pad_between_seqs)
    if pad_between_seqs is None:
        pad_between_seqs = detect_pad_between_seqs(cu_seqlens, cu_seqlens_padded)
    return _op.zero_padding_(
        x, cu_seqlens, cu_seqlens_padded, pad_between_seqs=pad_between_seqs, valid_end=valid_end
    )


def detection_stats() -> dict[str, int]:
    """Counters since the last clear: ``hits``, ``misses`` (eager), ``fallbacks`` (capture misses).

    ``size`` is the number of cached verdicts.
    """
    with _lock:
        return {**_stats, "size": len(_cache)}


def clear_detection_cache() -> None:
    """Drop every cached verdict and reset the counters."""
    with _lock:
        _cache.clear()
        for name in _stats:
            _stats[name] = 0


def valid_rows(cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, num_rows: int) -> Tensor:
    """Bool ``[num_rows]`` on the layout's device: True on real rows, False on padding and tail.

    Device-side (``searchsorted`` over the slot ends), no host sync, capture-safe.
    """
    fn = "valid_rows"
    check_cu_metadata(fn, cu_seqlens, cu_seqlens_padded)
    return valid_row_mask(cu_seqlens, cu_seqlens_padded, check_num_rows(fn, num_rows))
