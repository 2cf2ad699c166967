"""The THD layout contract: ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (slots).

Both are int32 tensors of shape ``[B+1]`` starting at 0. Sequence ``b`` has real length
``L_b = cu_seqlens[b+1] - cu_seqlens[b]`` and occupies the slot
``[cu_seqlens_padded[b], cu_seqlens_padded[b+1])`` of the ``T``-row buffer; its real rows are
the prefix ``[cu_seqlens_padded[b], cu_seqlens_padded[b] + L_b)`` and the rest of the slot is
padding. Rows at or beyond ``cu_seqlens_padded[-1]`` are reserved capacity (also padding).
``cu_seqlens_padded=None`` means the slots are the sequences (no padding between them).
Zero-length sequences, trailing zero-length placeholders and reserved capacity are valid.
Under context parallelism every slot length must be a multiple of ``2 * cp_size``.

:func:`validate` checks all of this eagerly (one device-to-host copy). It is skipped during
CUDA-graph capture and when switched off with :func:`set_validation` or ``THD_VALIDATE=0``.
:func:`pack_lengths` builds a layout from host lengths (the data-loader side).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from thd import _capture
from thd._runtime.config import validation_default
from thd.errors import ThdTypeError, ThdValueError

__all__ = [
    "INT32_MAX",
    "PackedLayout",
    "check_layout",
    "check_layout_async",
    "check_not_meta",
    "pack_lengths",
    "set_device_validation",
    "set_validation",
    "validate",
    "validation_enabled",
    "values_readable",
]

_NAMES = ("cu_seqlens", "cu_seqlens_padded")
INT32_MAX = 2**31 - 1
"""Largest offset a layout holds: ``cu_seqlens`` and ``cu_seqlens_padded`` are int32."""
_VALIDATION_ENABLED, _DEVICE_VALIDATION = validation_default()  # THD_VALIDATE


def set_validation(enabled: bool) -> bool:
    """Switch :func:`validate`'s value checks on or off for the process; returns the old setting.

    The default comes from the environment variable ``THD_VALIDATE`` (``0``/``false``/``off``
    disable it). Metadata checks (dtype, shape, device) always run.
    """
    global _VALIDATION_ENABLED
    previous = _VALIDATION_ENABLED
    _VALIDATION_ENABLED = bool(enabled)
    return previous


def validation_enabled() -> bool:
    """Whether :func:`validate` currently reads and checks values."""
    return _VALIDATION_ENABLED


def set_device_validation(enabled: bool) -> bool:
    """Check CUDA layouts on the device (``THD_VALIDATE=device``); returns the old setting.

    When on (and validation is on), value checks of CUDA tensors enqueue one asynchronous
    device assertion instead of a device-to-host read: no sync, allowed during CUDA-graph
    capture, and :func:`check_layout_async` checks layouts on paths that otherwise never
    validate. A failed assertion is reported at a later CUDA call and leaves the CUDA context
    unusable (restart the process), so this is a debugging aid. CPU tensors keep the host
    checks (their values are readable for free).
    """
    global _DEVICE_VALIDATION
    previous = _DEVICE_VALIDATION
    _DEVICE_VALIDATION = bool(enabled)
    return previous


def _on_device(*tensors: Tensor | None) -> bool:
    """Whether value checks of these tensors are device assertions (device mode, CUDA)."""
    return _VALIDATION_ENABLED and _DEVICE_VALIDATION and any(t is not None and t.is_cuda for t in tensors)


# ----------------------------------------------------------------------------- metadata checks


def _check_cu_tensor(fn: str, name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise ThdTypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ThdTypeError(f"{fn}: {name} dtype: expected torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] < 1:
        raise ThdValueError(f"{fn}: {name} shape: expected [B+1] with B >= 0, got {list(t.shape)}")
    return t


def check_cu_metadata(
    fn: str,
    cu_seqlens: object,
    cu_seqlens_padded: object | None,
    *,
    names: tuple[str, str] = ("cu_seqlens", "cu_seqlens_padded"),
) -> None:
    """Host-only checks (no device read): int32, 1-D, equal shapes, same device.

    ``names`` are the argument names used in error messages (e.g. ``cu_seqlens_q``).
    """
    name, name_padded = names
    cu = _check_cu_tensor(fn, name, cu_seqlens)
    if cu_seqlens_padded is None:
        return
    cup = _check_cu_tensor(fn, name_padded, cu_seqlens_padded)
    if cup.shape != cu.shape:
        raise ThdValueError(
            f"{fn}: {name_padded} shape: expected {list(cu.shape)} (same as {name}), got {list(cup.shape)}"
        )
    if cup.device != cu.device:
        raise ThdValueError(
            f"{fn}: {name_padded} device: expected {cu.device} (same as {name}), got {cup.device}"
        )


def check_cp(fn: str, cp_size: object, cp_rank: object | None = None) -> None:
    """Host-only checks of ``cp_size`` (int >= 1) and, if given, ``0 <= cp_rank < cp_size``."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ThdValueError(f"{fn}: cp_size: expected an int >= 1, got {cp_size!r}")
    if cp_rank is not None and (
        isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size
    ):
        raise ThdValueError(f"{fn}: cp_rank: expected an int in [0, {cp_size}), got {cp_rank!r}")


# ----------------------------------------------------------------------------- value checks


def _check_monotone(fn: str, name: str, values: Sequence[int]) -> None:
    if values[0] != 0:
        raise ThdValueError(f"{fn}: {name}[0] (={values[0]}): expected 0")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ThdValueError(
                f"{fn}: {name}[{i}] (={values[i]}) < {name}[{i - 1}] (={values[i - 1]}): "
                "expected non-decreasing"
            )


def check_layout_values(
    fn: str,
    cu: Sequence[int],
    cup: Sequence[int] | None,
    *,
    num_rows: int | None = None,
    cp_size: int = 1,
    names: tuple[str, str] = ("cu_seqlens", "cu_seqlens_padded"),
) -> None:
    """Check host copies of the cu tensors (see :func:`validate` for the rules).

    ``names`` are the argument names used in error messages.
    """
    _check_monotone(fn, names[0], cu)
    slots_name = names[0]
    if cup is not None:
        slots_name = names[1]
        _check_monotone(fn, slots_name, cup)
        for b in range(len(cu) - 1):
            real, slot = cu[b + 1] - cu[b], cup[b + 1] - cup[b]
            if slot < real:
                raise ThdValueError(
                    f"{fn}: slot {b} length ({slots_name}[{b + 1}] - {slots_name}[{b}] = {slot}) "
                    f"< real length ({names[0]}[{b + 1}] - {names[0]}[{b}] = {real}): "
                    "expected every slot to hold its sequence"
                )
    slots = cu if cup is None else cup
    if cp_size > 1:
        div = 2 * cp_size
        for b in range(len(slots) - 1):
            slot = slots[b + 1] - slots[b]
            if slot % div:
                raise ThdValueError(
                    f"{fn}: slot {b} length ({slots_name}[{b + 1}] - {slots_name}[{b}] = {slot}): "
                    f"expected a multiple of 2*cp_size = {div}"
                )
    if num_rows is not None:
        check_num_rows(fn, num_rows, cp_size)
        if slots[-1] > num_rows:
            raise ThdValueError(
                f"{fn}: num_rows (={num_rows}) < {slots_name}[-1] (={slots[-1]}): "
                "expected a buffer with room for every slot"
            )


def check_num_rows(fn: str, num_rows: object, cp_size: int = 1) -> int:
    """Host-only check of a buffer length; under CP it must split into ``2*cp_size`` chunks."""
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ThdValueError(f"{fn}: num_rows: expected an int >= 0, got {num_rows!r}")
    if cp_size > 1 and num_rows % (2 * cp_size):
        raise ThdValueError(
            f"{fn}: num_rows (={num_rows}): expected a multiple of 2*cp_size = {2 * cp_size} "
            "(reserved capacity beyond cu_seqlens_padded[-1] is split as one more slot); "
            "pad the buffer or grow the last slot"
        )
    return num_rows


def validate(
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor | None = None,
    *,
    num_rows: int | None = None,
    cp_size: int = 1,
) -> None:
    """Check a THD layout; raise :class:`~thd.errors.ThdTypeError` / :class:`~thd.errors.ThdValueError`.

    Rules: int32, 1-D ``[B+1]``, equal shapes and devices; both tensors start at 0 and are
    non-decreasing; every slot is at least as long as its real length; the slots fit in
    ``num_rows`` (if given); with ``cp_size > 1`` every slot length (and ``num_rows``) is a
    multiple of ``2 * cp_size``.

    Metadata checks always run; meta tensors (no values to check) are a
    :class:`~thd.errors.ThdValueError`. Value checks cost one device-to-host copy and are skipped
    silently while a CUDA graph is being captured (reading device memory is illegal there)
    and when validation is switched off
    (:func:`set_validation`, ``THD_VALIDATE=0``). Validate once per batch, before capture or
    outside the step. With ``THD_VALIDATE=device`` CUDA layouts are checked by an
    asynchronous device assertion instead (no sync, also under capture; see
    :func:`set_device_validation`).

    Example::

        >>> validate(torch.tensor([0, 3, 5], dtype=torch.int32),
        ...          torch.tensor([0, 4, 8], dtype=torch.int32), num_rows=8, cp_size=2)
    """
    check_layout("validate", cu_seqlens, cu_seqlens_padded, num_rows=num_rows, cp_size=cp_size)
    check_not_meta("validate", cu_seqlens, cu_seqlens_padded)


def check_not_meta(
    fn: str, cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, *, names: tuple[str, str] = _NAMES
) -> None:
    """Refuse meta offsets where values are needed: a meta tensor holds none to check or index with."""
    for name, t in zip(names, (cu_seqlens, cu_seqlens_padded), strict=True):
        if t is not None and t.is_meta:
            raise ThdValueError(
                f"{fn}: {name} device: expected a device holding values, got meta "
                "(meta tensors carry shapes only: there are no offsets to check or index with)"
            )


def values_readable(*tensors: Tensor | None) -> bool:
    """Whether value checks may read these tensors now: validation on, not capturing, none on meta,
    and not checked on the device instead (``THD_VALIDATE=device``)."""
    if not _VALIDATION_ENABLED or _on_device(*tensors) or any(t is not None and t.is_meta for t in tensors):
        return False
    return not _capture.is_capturing()


def check_layout_async(
    fn: str,
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor | None,
    *,
    num_rows: int | None = None,
    cp_size: int = 1,
) -> bool:
    """With ``THD_VALIDATE=device``, assert the layout rules on the device (no sync); else nothing.

    For paths that must not read the device (``max_seqlen_*`` given, capture): see
    :func:`set_device_validation`. Metadata is not checked here. Returns whether the assertion
    was queued (:func:`check_layout` then reads nothing).
    """
    if _on_device(cu_seqlens, cu_seqlens_padded):
        _assert_layout(fn, cu_seqlens, cu_seqlens_padded, num_rows, cp_size)
        return True
    return False


def _assert_layout(
    fn: str, cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, num_rows: int | None, cp_size: int
) -> None:
    """One asynchronous device assertion of every value rule of :func:`validate`."""
    cu = cu_seqlens.long()
    slots = cu if cu_seqlens_padded is None else cu_seqlens_padded.long()
    real, room = cu.diff(), slots.diff()
    ok = [cu[0] == 0, slots[0] == 0, (real >= 0).all(), (room >= real).all()]
    if cp_size > 1:
        ok.append((room % (2 * cp_size) == 0).all())
    if num_rows is not None:
        ok.append(slots[-1] <= num_rows)
    torch._assert_async(
        torch.stack(ok).all(),
        f"{fn}: invalid THD layout (THD_VALIDATE=device): cu_seqlens / cu_seqlens_padded must start at 0, "
        f"be non-decreasing, hold every sequence in its slot"
        + (f", have slots that are multiples of 2*cp_size = {2 * cp_size}" if cp_size > 1 else "")
        + (f" and end within num_rows = {num_rows}" if num_rows is not None else ""),
    )


def check_layout(
    fn: str,
    cu_seqlens: object,
    cu_seqlens_padded: object | None,
    *,
    names: tuple[str, str] = ("cu_seqlens", "cu_seqlens_padded"),
    num_rows: int | None = None,
    cp_size: int = 1,
) -> None:
    """:func:`validate` with the caller's name ``fn`` and argument ``names`` in error messages: the
    metadata checks, then :func:`check_layout_async`'s device assertion or, where values may be
    read, the host checks of one copy."""
    check_cu_metadata(fn, cu_seqlens, cu_seqlens_padded, names=names)
    check_cp(fn, cp_size)
    if num_rows is not None:
        check_num_rows(fn, num_rows, cp_size)
    assert isinstance(cu_seqlens, Tensor)
    assert cu_seqlens_padded is None or isinstance(cu_seqlens_padded, Tensor)
    on_device = check_layout_async(fn, cu_seqlens, cu_seqlens_padded, num_rows=num_rows, cp_size=cp_size)
    if on_device or not values_readable(cu_seqlens, cu_seqlens_padded):
        return
    if cu_seqlens_padded is None:
        cu, cup = cu_seqlens.tolist(), None
    else:
        both = torch.stack((cu_seqlens, cu_seqlens_padded)).tolist()  # the one D2H copy
        cu, cup = both[0], both[1]
    check_layout_values(fn, cu, cup, num_rows=num_rows, cp_size=cp_size, names=names)


# ----------------------------------------------------------------------------- packing helper


@dataclass(frozen=True)
class PackedLayout:
    """A padded THD layout built on the host by :func:`pack_lengths`.

    Attributes:
        cu_seqlens: int32 ``[B+1]``, cumulative real lengths.
        cu_seqlens_padded: int32 ``[B+1]``, slot offsets.
        index: int64 ``[sum(L)]``, the buffer row of each real token in packed (unpadded) order.
        num_rows: ``T``, buffer rows (``>= cu_seqlens_padded[-1]``; the rest is reserved capacity).
        max_seqlen: longest real length (0 if none).
        max_seqlen_padded: longest slot (0 if none).
        lengths, padded_lengths: the host lengths per sequence.
        cp_size: the CP size the slots were padded for.
        pad_between_seqs: host verdict of :func:`thd.padding.detect_pad_between_seqs` for this
            ``cp_size``; pass it as an explicit ``pad_between_seqs=`` to skip detection.
    """

    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    index: Tensor
    num_rows: int
    max_seqlen: int
    max_seqlen_padded: int
    lengths: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    cp_size: int
    pad_between_seqs: bool

    @property
    def valid_end(self) -> int:
        """Host end of the last real row (``cup[B-1] + L_{B-1}``; 0 if ``B == 0``)."""
        for b in range(len(self.lengths) - 1, -1, -1):
            if self.lengths[b]:
                return sum(self.padded_lengths[:b]) + self.lengths[b]
        return 0

    def pack(self, tokens: Tensor) -> Tensor:
        """Scatter ``tokens`` ``[sum(L), ...]`` into a zero-padded ``[num_rows, ...]`` buffer."""
        out = tokens.new_zeros((self.num_rows, *tokens.shape[1:]))
        out.index_copy_(0, self.index.to(tokens.device), tokens)
        return out

    def unpack(self, rows: Tensor) -> Tensor:
        """Gather the real rows of a ``[num_rows, ...]`` buffer into ``[sum(L), ...]``."""
        return rows.index_select(0, self.index.to(rows.device))


def _host_lengths(fn: str, lengths: object) -> tuple[int, ...]:
    """``lengths`` as a tuple of ints >= 0 (ints, numpy or 0-d integer tensors; never bool or float)."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise ThdTypeError(f"{fn}: lengths: expected a sequence of ints, got {type(lengths).__name__}")
    lens = []
    for b, n in enumerate(lengths):
        try:
            if isinstance(n, bool):
                raise TypeError
            value = operator.index(n)
        except (TypeError, RuntimeError, ValueError):  # a float, a str, a tensor that is not one int
            raise ThdTypeError(
                f"{fn}: lengths[{b}]: expected an int, got {type(n).__name__} {n!r:.40}"
            ) from None
        if value < 0:
            raise ThdValueError(f"{fn}: lengths[{b}] (={value}): expected >= 0")
        lens.append(value)
    return tuple(lens)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_lengths(
    lengths: Sequence[int],
    *,
    cp_size: int = 1,
    num_rows: int | None = None,
    device: torch.device | str | None = None,
    pad_multiple: int | None = None,
) -> PackedLayout:
    """Pack host real lengths into a padded THD layout (no device sync; three small host-to-device copies).

    Each slot is the real length rounded up to ``pad_multiple`` (default ``2 * cp_size`` when
    ``cp_size > 1``, else 1: no padding). ``num_rows`` (default ``cu_seqlens_padded[-1]``) adds
    reserved capacity; under CP it must be a multiple of ``2 * cp_size``.

    Example::

        >>> layout = pack_lengths([5, 8], cp_size=2)
        >>> layout.cu_seqlens.tolist(), layout.cu_seqlens_padded.tolist()
        ([0, 5, 13], [0, 8, 16])
    """
    fn = "pack_lengths"
    check_cp(fn, cp_size)
    multiple = pad_multiple if pad_multiple is not None else (2 * cp_size if cp_size > 1 else 1)
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ThdValueError(f"{fn}: pad_multiple: expected an int >= 1, got {pad_multiple!r}")
    if cp_size > 1 and multiple % (2 * cp_size):
        raise ThdValueError(
            f"{fn}: pad_multiple (={multiple}): expected a multiple of 2*cp_size = {2 * cp_size}"
        )
    lens = _host_lengths(fn, lengths)
    padded = tuple(_round_up(n, multiple) for n in lens)
    cu = [0, *accumulate(lens)]
    cup = [0, *accumulate(padded)]
    if cup[-1] > INT32_MAX:  # before any allocation: the offsets are int32
        raise ThdValueError(
            f"{fn}: lengths: expected slots totalling at most {INT32_MAX} rows (int32 offsets), "
            f"got {cup[-1]} (sum of lengths {cu[-1]}, pad_multiple {multiple})"
        )
    rows = cup[-1] if num_rows is None else check_num_rows(fn, num_rows, cp_size)
    if rows < cup[-1]:
        raise ThdValueError(f"{fn}: num_rows (={rows}) < cu_seqlens_padded[-1] (={cup[-1]}): expected room")
    lens_t = torch.tensor(lens, dtype=torch.int64)
    shift = torch.repeat_interleave(
        torch.tensor(cup[:-1], dtype=torch.int64) - torch.tensor(cu[:-1], dtype=torch.int64), lens_t
    )
    index = torch.arange(cu[-1], dtype=torch.int64) + shift
    cu_t = torch.tensor(cu, dtype=torch.int32)
    cup_t = torch.tensor(cup, dtype=torch.int32)
    if cp_size > 1:
        last = max((b for b, n in enumerate(lens) if n), default=-1)
        pad_between = cu[: last + 2] != cup[: last + 2]
    else:
        pad_between = cu[:-1] != cup[:-1]
    return PackedLayout(
        cu_seqlens=cu_t.to(device) if device is not None else cu_t,
        cu_seqlens_padded=cup_t.to(device) if device is not None else cup_t,
        index=index.to(device) if device is not None else index,
        num_rows=rows,
        max_seqlen=max(lens, default=0),
        max_seqlen_padded=max(padded, default=0),
        lengths=lens,
        padded_lengths=padded,
        cp_size=cp_size,
        pad_between_seqs=pad_between,
    )
