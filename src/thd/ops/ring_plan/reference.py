"""Pure-torch ring plan tables: the oracle and the CPU path (a few dozen small torch ops)."""

from __future__ import annotations

import torch
from torch import Tensor

from thd._cp_index import all_rank_cu_seqlens, local_cu_seqlens_padded

__all__ = ["ring_plan_tables_reference"]


def ring_plan_tables_reference(
    cu_seqlens: Tensor, cu_seqlens_padded: Tensor, cp_size: int, *, exact: bool
) -> Tensor:
    """See :func:`thd.ops.ring_plan.ring_plan_tables` for the layout of the result."""
    cp, num_seqs = cp_size, cu_seqlens.shape[0] - 1
    out = cu_seqlens.new_zeros(3 * cp + 2, num_seqs + 2)
    if exact:
        out[: 3 * cp, 1:] = all_rank_cu_seqlens(cu_seqlens, cu_seqlens_padded, cp).reshape(3 * cp, -1)
    else:  # every chunk full: the cumulative counts are the global ones divided
        both = torch.div(cu_seqlens, cp, rounding_mode="floor").expand(cp, -1)
        half = torch.div(cu_seqlens, 2 * cp, rounding_mode="floor").expand(2 * cp, -1)
        out[: 3 * cp, 1:] = torch.cat((both, half))
    local = local_cu_seqlens_padded(cu_seqlens_padded, cp)
    out[3 * cp, 1:] = local
    out[3 * cp + 1, 1:-1] = torch.div(local[:-1] + local[1:], 2, rounding_mode="floor")
    out[3 * cp + 1, -1] = local[-1]
    return out
