"""Launcher and dispatch of :func:`ring_plan_tables`."""

from __future__ import annotations

import torch
from torch import Tensor

from thd._runtime.families import runs_triton
from thd._runtime.launcher import launcher_for
from thd.ops.ring_plan.reference import ring_plan_tables_reference

__all__ = ["ring_plan_tables"]

_BLOCK = 1024


def ring_plan_tables(cu_seqlens: Tensor, cu_seqlens_padded: Tensor, cp_size: int, *, exact: bool) -> Tensor:
    """Every count and offset table a ring rank needs, as views of one int32 ``[3cp+2, B+2]`` tensor.

    ``cu_seqlens`` are the GLOBAL cumulative real lengths, ``cu_seqlens_padded`` the GLOBAL slot
    offsets (every slot a multiple of ``2 * cp_size``). Row ``h * cp + j`` is ``[0, *cu]`` where
    ``cu`` is the ``[B+1]`` cumulative real-row count of rank ``j``'s local slots over both halves
    (``h = 0``), the first half (``h = 1``) or the second half (``h = 2``): with ``exact`` the
    counts of :func:`thd.cp.partition.all_rank_cu_seqlens`, otherwise the no-padding shortcut
    ``cu_seqlens // cp`` (``// 2cp`` for halves). Row ``3cp`` is ``[0, *cu_seqlens_padded // cp]``
    (the local slot offsets) and row ``3cp + 1`` is ``[0, *half_starts, end]`` (local offsets of
    the second halves). Slicing ``[1:]`` gives a ``[B+1]`` table, the full row the same table
    after one leading empty sequence. One Triton launch on GPUs (capture-safe, no sync); the
    torch reference elsewhere.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    if not runs_triton(cu_seqlens):
        return ring_plan_tables_reference(cu_seqlens, cu_seqlens_padded, cp_size, exact=exact)
    from thd.ops.ring_plan.kernels import _ring_plan_kernel

    out = torch.empty(3 * cp_size + 2, num_seqs + 2, dtype=torch.int32, device=cu_seqlens.device)
    block = min(_BLOCK, max(16, 1 << num_seqs.bit_length()))
    launcher_for(_ring_plan_kernel).run(
        (3 * cp_size + 2,),
        cu_seqlens,
        cu_seqlens_padded,
        out,
        num_seqs,
        cp_size,
        out.stride(0),
        EXACT=exact,
        BLOCK=block,
    )
    return out
