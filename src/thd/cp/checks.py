"""Argument checks of :func:`thd.cp.ring_attention`: host-only metadata, a cross-rank shard
check, and value checks that run only where a device-to-host read is allowed."""

from __future__ import annotations

import torch
from torch import Tensor

from thd import layout as _layout
from thd._capture import is_capturing
from thd.cp.comm import RingComm, all_gather_ints
from thd.errors import ThdDistributedError, ThdValueError
from thd.ops.attention.arguments import check_sinks, passes_call_checks
from thd.ops.attention.checks import check_layout_tensors, check_max_seqlen, check_qkv
from thd.ops.attention.keywords import ScoreArgs, score_options
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = [
    "check_metadata",
    "check_scores",
    "check_shards",
    "check_values",
    "max_len",
    "resolve_max_seqlen",
]

_FN = "ring_attention"


def check_metadata(q: Tensor, k: Tensor, v: Tensor, given: VarlenLayout, causal: bool) -> None:
    """Host-only checks of the shards and the layout ``given`` (the GLOBAL offsets and bounds as
    passed, unchecked): types, shapes, dtypes, devices (never reads device memory)."""
    common = passes_call_checks(q, k, v, given, None)  # True: every check below but the causal one passes
    if not common:
        check_qkv(_FN, q, k, v)
    if causal and q.shape[0] != k.shape[0]:
        raise ThdValueError(
            f"{_FN}: shard rows: causal ring attention is self-attention, expected q and k/v with the "
            f"same number of rows, got {q.shape[0]} and {k.shape[0]}"
        )
    if not common:
        check_layout_tensors(_FN, q, k, *given.tensors()[:4])
        check_max_seqlen(_FN, "max_seqlen_q", given.max_seqlen_q)
        check_max_seqlen(_FN, "max_seqlen_kv", given.max_seqlen_kv)


def check_scores(q: Tensor, scores: ScoreArgs) -> AttentionOptions:
    """The checks of :func:`thd.attention` for the scale, window, softcap and sinks (host only);
    returns the resolved options (scale defaulted to ``D ** -0.5``, causal to True)."""
    options = score_options(_FN, q, scores, causal=True)
    sinks = scores.get("sinks")
    if sinks is not None:
        check_sinks(_FN, q, sinks)
    return options


def check_shards(comm: RingComm, q: Tensor, k: Tensor, v: Tensor, error: Exception | None) -> None:
    """All ranks must pass shards of one shape; a rank whose own checks failed is reported everywhere."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    code = dtypes.index(q.dtype) if q.dtype in dtypes else len(dtypes)
    rows = all_gather_ints(
        comm.group, q.device, [*q.shape, *k.shape, v.shape[2], code, int(error is not None)]
    )
    if error is not None:
        raise error
    failed = [rank for rank, row in enumerate(rows) if row[-1]]
    if failed:
        raise ThdDistributedError(f"{_FN}: group ranks {failed} rejected their arguments (see their errors)")
    names = "[Tq, Hq, D, Tkv, Hkv, D, Dv, dtype]"
    for rank, row in enumerate(rows):
        if row[:-1] != rows[0][:-1]:
            raise ThdValueError(
                f"{_FN}: shard shapes differ across the group: rank {rank} has {names} = {row[:-1]}, "
                f"rank 0 has {rows[0][:-1]}; every rank must pass its thd.cp.partition shard of one batch"
            )


def check_values(given: VarlenLayout, cp: int, rows_q: int, rows_kv: int, causal: bool) -> None:
    """Value checks of ``given`` (device-to-host reads) for shards of ``rows_q`` / ``rows_kv`` rows:
    layout rules, divisibility by ``2*cp``, causal pairing, ``max_seqlen_*`` as upper bounds."""
    if not _layout.validation_enabled():
        return
    cu_q, cu_kv = given.cu_seqlens_q, given.cu_seqlens_kv
    sides = (
        ("q", cu_q, given.cu_seqlens_q_padded, rows_q),
        ("kv", cu_kv, given.cu_seqlens_kv_padded, rows_kv),
    )
    for side, cu, cup, rows in sides:
        try:
            _layout.validate(cu, cup, num_rows=rows * cp, cp_size=cp)
        except ThdValueError as exc:
            raise ThdValueError(
                f"{_FN}: {side} layout for a group of cp_size={cp} (shard rows {rows}): {exc}"
            ) from None
    if causal and (not torch.equal(cu_q, cu_kv) or not torch.equal(given.slots_q, given.slots_kv)):
        raise ThdValueError(
            f"{_FN}: causal ring attention needs identical q and kv layouts "
            f"(cu_seqlens_q == cu_seqlens_kv and cu_seqlens_q_padded == cu_seqlens_kv_padded)"
        )
    for name, cu, m in (
        ("max_seqlen_q", cu_q, given.max_seqlen_q),
        ("max_seqlen_kv", cu_kv, given.max_seqlen_kv),
    ):
        real = max_len(cu)
        if m is not None and m < real:
            raise ThdValueError(
                f"{_FN}: {name} (={m}) < largest real length ({real}): expected an upper bound"
            )


def max_len(cu: Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def resolve_max_seqlen(name: str, cu: Tensor, given: int | None) -> int:
    if given is not None:
        return given
    if is_capturing():
        raise ThdValueError(
            f"{_FN}: {name} is None during CUDA-graph capture; pass the largest real sequence "
            "length (deriving it needs a device-to-host read)"
        )
    return max_len(cu)
