"""Pure-torch LSE merge: the oracle and CPU fallback, not fast."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["merge_partials_reference"]


def merge_partials_reference(
    parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) * out_i`` in fp32.

    Rows where every ``lse_i`` is ``-inf`` get ``-inf`` and weight 0 everywhere (never NaN); a
    NaN ``lse_i`` makes the merged row NaN in ``lse`` and ``out`` (never hidden as ``-inf``).
    """
    lses = torch.stack([lse for _, lse in parts])  # [n, H, T]
    hi = lses.amax(dim=0)
    hi = hi.masked_fill(hi == float("-inf"), 0.0)
    weights = torch.exp(lses - hi)  # <= 1; all 0 where every part is -inf
    total = weights.sum(dim=0)
    has_any = total != 0  # True for NaN: it propagates
    lse = torch.where(has_any, hi + torch.log(total), float("-inf"))
    weights = weights * torch.where(has_any, total.reciprocal(), 0.0)
    out = sum(o.float() * w.t().unsqueeze(-1) for (o, _), w in zip(parts, weights, strict=True))
    return out.to(dtype), lse  # type: ignore[union-attr]
