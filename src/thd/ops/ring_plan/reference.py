"""Pure-torch ring plan tables: the oracle and the CPU path (a few dozen small torch ops)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ring_plan_tables_reference"]


def ring_plan_tables_reference(
    cu_seqlens: Tensor, cu_seqlens_padded: Tensor, cp_size: int, *, exact: bool
) -> Tensor:
    """See :func:`thd.ops.ring_plan.ring_plan_tables` for the layout of the result."""
    cp, num_seqs = cp_size, cu_seqlens.shape[0] - 1
    cu, cup = cu_seqlens.long(), cu_seqlens_padded.long()
    out = torch.zeros(3 * cp + 2, num_seqs + 2, dtype=torch.int64, device=cu.device)
    ranks = torch.arange(cp, device=cu.device)[:, None]
    if exact:
        lengths = (cu[1:] - cu[:-1])[None, :]
        chunk = torch.div(cup[1:] - cup[:-1], 2 * cp, rounding_mode="floor")[None, :]
        first = torch.minimum((lengths - ranks * chunk).clamp(min=0), chunk)
        second = torch.minimum((lengths - (2 * cp - 1 - ranks) * chunk).clamp(min=0), chunk)
        counts = torch.cat((first + second, first, second))  # [3cp, B]
        out[: 3 * cp, 2:] = counts.cumsum(dim=1)
    else:  # every chunk full: the cumulative counts are the global ones divided
        both = torch.div(cu[1:], cp, rounding_mode="floor").expand(cp, num_seqs)
        half = torch.div(cu[1:], 2 * cp, rounding_mode="floor").expand(cp, num_seqs)
        out[: 3 * cp, 2:] = torch.cat((both, half, half))
    local = torch.div(cup, cp, rounding_mode="floor")
    out[3 * cp, 1:] = local
    out[3 * cp + 1, 1:-1] = torch.div(local[:-1] + local[1:], 2, rounding_mode="floor")
    out[3 * cp + 1, -1] = local[-1]
    return out.to(torch.int32)
