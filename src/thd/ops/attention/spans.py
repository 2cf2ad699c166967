"""Host row spans of a THD layout, clamped to the buffer exactly as the kernels clamp them.

The torch reference reads every sequence's span on the host (one device-to-host copy). On the
unvalidated path (both ``max_seqlen_*`` given) the offsets may be invalid: decreasing, negative,
past the buffer or near ``2**31``. The kernels then clamp each span to the tensor
(``geometry.span``) and give garbage values, never an exception; :func:`clamped_spans` applies the
same rule, so the reference does too, in O(B) host work whatever the offsets say.
"""

from __future__ import annotations

from torch import Tensor

from thd.errors import ThdValueError

__all__ = ["clamped_spans"]


def clamped_spans(
    cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, *, num_rows: int
) -> list[tuple[int, int]]:
    """``(start_row, length)`` per sequence: ``start = clamp(slot_start, 0, num_rows)`` and
    ``length = clamp(cu[b+1] - cu[b], 0, num_rows - start)`` (Python ints: no int32 overflow).

    A valid layout inside ``num_rows`` rows is returned unchanged. Meta tensors hold no offsets: a
    :class:`~thd.errors.ThdValueError`.
    """
    if cu_seqlens.is_meta or (cu_seqlens_padded is not None and cu_seqlens_padded.is_meta):
        raise ThdValueError(
            "reference attention: cu_seqlens device: meta tensors hold no lengths; "
            "pass them on a real device (or q, k, v on meta too, for shapes only)"
        )
    cu = cu_seqlens.tolist()
    starts = cu if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
    spans = []
    for b in range(len(cu) - 1):
        start = min(max(starts[b], 0), num_rows)
        spans.append((start, min(max(cu[b + 1] - cu[b], 0), num_rows - start)))
    return spans
