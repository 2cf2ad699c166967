"""LSE merge: the Triton kernel (interpreter on CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import assert_close
from thd.ops.lse_merge import merge_partials
from thd.ops.lse_merge.reference import merge_partials_reference


def _parts(
    n: int, rows: int, heads: int, dv: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    parts = []
    for i in range(n):
        out = torch.randn(rows, heads, dv).to(dtype)
        lse = torch.randn(heads, rows) * 3
        lse[:, :4] = float("-inf")  # rows empty in every part
        out[:4] = 0
        lse[:, 5 + i] = float("-inf")  # a row empty in one part only
        out[5 + i] = 0
        parts.append((out, lse))
    return parts


@pytest.mark.parametrize("n", [2, 3, 4], ids=lambda n: f"parts{n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_lse_merge_matches_reference(n: int, dtype: torch.dtype) -> None:
    parts = _parts(n, 37, 3, 96, dtype)
    out, lse = merge_partials(parts, dtype)
    ref_out, ref_lse = merge_partials_reference(parts, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, "out", atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert_close(lse[finite], ref_lse[finite], "lse", atol=1e-5, rtol=1e-5)


def test_lse_merge_keeps_empty_rows_exact() -> None:
    """-inf on every side stays -inf (never NaN) and the output rows stay exact zeros."""
    parts = _parts(2, 16, 2, 32, torch.float32)
    out, lse = merge_partials(parts, torch.float32)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[:, :4]).all()
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))


def test_lse_merge_matches_direct_softmax() -> None:
    """Splitting keys in two and merging equals attention over all keys (independent oracle)."""
    q, k, v = torch.randn(5, 2, 32), torch.randn(12, 2, 32), torch.randn(12, 2, 32)
    scores = torch.einsum("qhd,khd->hqk", q, k)

    def part(sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
        s = scores[..., sl]
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[sl]), torch.logsumexp(s, -1)

    out, lse = merge_partials([part(slice(0, 7)), part(slice(7, 12))], torch.float32)
    full = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    assert_close(out, full, "out", atol=1e-5, rtol=1e-5)
    assert_close(lse, torch.logsumexp(scores, -1), "lse", atol=1e-5, rtol=1e-5)
