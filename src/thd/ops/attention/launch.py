"""Launchers for the Triton attention kernels: tiles, autotuning, grids, allocation."""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from thd.ops.attention import kernels

__all__ = ["backward", "forward"]

# Read once at import, as Triton decides interpreter vs compiler when kernels are decorated.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_AUTOTUNE = os.environ.get("THD_AUTOTUNE", "1") != "0"


def _config(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def _pruner(max_tile_for_large_head_dim: int):  # type: ignore[no-untyped-def]
    """Keep only tiles that fit in shared memory when a head dim exceeds 128."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
        head_dim = max(int(kwargs.get("BLOCK_D", 128)), int(kwargs.get("BLOCK_DV", 128)))  # type: ignore[call-overload]
        kept = [
            c
            for c in configs
            if head_dim <= 128
            or (
                c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= max_tile_for_large_head_dim and c.num_stages <= 2
            )
        ]
        kept = kept or [_config(32, 32, 4, 1)]
        return kept if _AUTOTUNE else kept[:1]

    return prune


if _INTERPRET:
    _FWD_CONFIGS = [_config(32, 32, 4, 1)]
    _BWD_CONFIGS = [_config(32, 32, 4, 1)]
else:
    _FWD_CONFIGS = [
        _config(128, 64, 8, 3),
        _config(128, 128, 8, 3),
        _config(128, 64, 4, 3),
        _config(128, 32, 4, 3),
        _config(64, 64, 4, 3),
        _config(64, 64, 4, 2),
        _config(64, 32, 4, 2),
    ]
    _BWD_CONFIGS = [
        _config(64, 128, 8, 2),
        _config(64, 64, 4, 2),
        _config(32, 128, 8, 2),
        _config(128, 64, 8, 2),
        _config(32, 64, 4, 2),
    ]

if not _AUTOTUNE:  # one good config each: fast compiles for tests
    _FWD_CONFIGS = [_config(64, 64, 4, 3), _config(64, 32, 4, 2)]
    _BWD_CONFIGS = [_config(64, 64, 4, 2), _config(32, 64, 4, 2)]

_KEY = ["seq_bucket", "HEAD_DIM", "HEAD_DIM_V", "IS_CAUSAL", "GROUP"]


def _autotune(configs: list[triton.Config], max_tile: int, fn, *, in_place: bool = False):  # type: ignore[no-untyped-def]
    """``in_place``: the kernel may update out/lse in place (the forward's ACCUMULATE), so
    autotuning restores them after each trial and the mode is part of the key."""
    prune = {"early_config_prune": _pruner(max_tile)}
    restore = ["out_ptr", "lse_ptr"] if in_place else None
    key = [*_KEY, "ACCUMULATE"] if in_place else _KEY
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune, restore_value=restore)(fn)


_fwd_kernel = _autotune(_FWD_CONFIGS, 64 * 64, kernels._attention_fwd_kernel, in_place=True)
_dkdv_kernel = _autotune(_BWD_CONFIGS, 32 * 64, kernels._attention_bwd_dkdv_kernel)
_DQ_CONFIGS = _FWD_CONFIGS if _INTERPRET else [_config(128, 64, 8, 3), *_FWD_CONFIGS]
_dq_kernel = _autotune(_DQ_CONFIGS, 64 * 64, kernels._attention_bwd_dq_kernel)


def _rows_major(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _seq_bucket(max_seqlen: int) -> int:
    return triton.next_power_of_2(max(int(max_seqlen), 16))


def _head_meta(q: Tensor, k: Tensor, v: Tensor) -> dict[str, int | bool]:
    return {
        "GROUP": q.shape[1] // k.shape[1],
        "HEAD_DIM": q.shape[2],
        "HEAD_DIM_V": v.shape[2],
        "BLOCK_D": triton.next_power_of_2(q.shape[2]),
        "BLOCK_DV": triton.next_power_of_2(v.shape[2]),
        "UPCAST": _INTERPRET and q.dtype == torch.bfloat16,
    }


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_kv: Tensor,
    cup_q: Tensor | None,
    cup_kv: Tensor | None,
    max_seqlen_q: int,
    causal: bool,
    scale: float,
    accumulate: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """One kernel launch: ``(out, lse)``, padding rows written as 0 / -inf by the kernel.

    ``accumulate=(out, lse)``: fold this launch into that normalised partial result in place
    (only its real rows are read and written) and return it.
    """
    q, k, v = _rows_major(q), _rows_major(k), _rows_major(v)
    num_rows, num_heads, num_seqs = q.shape[0], q.shape[1], cu_q.shape[0] - 1
    if accumulate is None:
        out = q.new_empty(num_rows, num_heads, v.shape[2])
        lse = q.new_empty(num_heads, num_rows, dtype=torch.float32)
    else:
        out, lse = accumulate
    if num_rows == 0:
        return out, lse
    grid = lambda meta: (max(1, triton.cdiv(max_seqlen_q, meta["BLOCK_M"])), num_heads, num_seqs + 1)
    _fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_kv,
        cu_q if cup_q is None else cup_q,
        cu_kv if cup_kv is None else cup_kv,
        num_rows,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        scale,
        _seq_bucket(max_seqlen_q),
        IS_CAUSAL=causal,
        ACCUMULATE=accumulate is not None,
        **_head_meta(q, k, v),
    )
    return out, lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_kv: Tensor,
    cup_q: Tensor | None,
    cup_kv: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Preprocess, dK/dV and dQ launches: ``(dq, dk, dv)``, padding rows written as 0."""
    do, q, k, v, out = (_rows_major(t) for t in (do, q, k, v, out))
    lse = lse.contiguous()
    num_heads, num_kv_heads, num_seqs = q.shape[1], k.shape[1], cu_q.shape[0] - 1
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cup_q_ = cu_q if cup_q is None else cup_q
    cup_kv_ = cu_kv if cup_kv is None else cup_kv
    meta = _head_meta(q, k, v)
    delta = torch.empty_like(lse)
    bucket = _seq_bucket(max(max_seqlen_q, max_seqlen_kv))
    if num_seqs > 0 and max_seqlen_q > 0 and q.shape[0] > 0:
        pre_block = 64
        kernels._attention_bwd_preprocess_kernel[(triton.cdiv(max_seqlen_q, pre_block), num_heads, num_seqs)](
            out,
            do,
            delta,
            cu_q,
            cup_q_,
            out.stride(0),
            out.stride(1),
            do.stride(0),
            do.stride(1),
            delta.stride(0),
            HEAD_DIM_V=v.shape[2],
            BLOCK_DV=meta["BLOCK_DV"],
            BLOCK_M=pre_block,
        )
    strides_in = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        do.stride(0),
        do.stride(1),
    )
    if k.shape[0] > 0:
        grid_kv = lambda m: (max(1, triton.cdiv(max_seqlen_kv, m["BLOCK_N"])), num_kv_heads, num_seqs + 1)
        _dkdv_kernel[grid_kv](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            cu_q,
            cu_kv,
            cup_q_,
            cup_kv_,
            k.shape[0],
            *strides_in,
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            lse.stride(0),
            scale,
            bucket,
            IS_CAUSAL=causal,
            **meta,
        )
    if q.shape[0] > 0:
        grid_q = lambda m: (max(1, triton.cdiv(max_seqlen_q, m["BLOCK_M"])), num_heads, num_seqs + 1)
        _dq_kernel[grid_q](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            cu_q,
            cu_kv,
            cup_q_,
            cup_kv_,
            q.shape[0],
            *strides_in,
            dq.stride(0),
            dq.stride(1),
            lse.stride(0),
            scale,
            bucket,
            IS_CAUSAL=causal,
            **meta,
        )
    return dq, dk, dv
