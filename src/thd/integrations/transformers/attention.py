"""The attention function registered with ``transformers.AttentionInterface``.

transformers calls it as ``fn(module, query, key, value, attention_mask, dropout=...,
scaling=..., sliding_window=..., softcap=..., is_causal=..., s_aux=..., **kwargs)`` (the
keywords of its ``flash_attention_forward``) with
``query [B, Hq, S, D]`` and ``key``/``value [B, Hkv, S_kv, D]`` and expects
``(attn_output [B, S, Hq, Dv], None)``. The rows are flattened to ``[B*S, H, D]`` (a view when
the projections left them ``[B, S, H, D]`` in memory) and run as one THD call; without a CP
group through ``thd.attention`` (layout from :mod:`.layout`), with one through
``thd.cp.ring_attention`` on the global layout that :func:`.cp.shard_batch` puts in the kwargs
(``thd.cp.document_attention`` for a batch sharded with ``mode="documents"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import thd
from thd.errors import ThdValueError
from thd.integrations.transformers.cp import LAYOUT_KWARG, CPLayout, DocumentCPLayout
from thd.integrations.transformers.features import check_unsupported, feature_kwargs
from thd.integrations.transformers.layout import Layout, resolve_layout

__all__ = ["AttentionFn", "make_attention_function"]

AttentionFn = Callable[..., tuple[Tensor, None]]


def _rows(x: Tensor) -> Tensor:
    """``[B, H, S, D]`` -> ``[B*S, H, D]`` (a view if the memory is ``[B, S, H, D]``)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _is_causal(module: torch.nn.Module, is_causal: bool | None) -> bool:
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def _local(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Layout,
    *,
    causal: bool,
    scale: float | None,
    features: dict[str, Any],
) -> Tensor:
    extra = feature_kwargs(causal=causal, **features)
    out = thd.attention(q, k, v, **layout.kwargs(), causal=causal, softmax_scale=scale, **extra)
    assert isinstance(out, Tensor)
    return out


def _check_cp_size(cp_size: int, group: dist.ProcessGroup) -> None:
    if cp_size != dist.get_world_size(group):
        raise ThdValueError(
            f"thd attention: the batch was sharded for cp={cp_size}, the registered group has "
            f"{dist.get_world_size(group)} ranks"
        )


def _ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: object,
    group: dist.ProcessGroup,
    *,
    causal: bool,
    scale: float | None,
    features: dict[str, Any],
) -> Tensor:
    from thd.cp import document_attention, ring_attention

    if isinstance(layout, DocumentCPLayout):
        _check_cp_size(layout.cp_size, group)
        extra = feature_kwargs(causal=causal, **features)
        return document_attention(
            q, k, v, layout.layout, group=group, causal=causal, softmax_scale=scale, **extra
        )
    if not isinstance(layout, CPLayout):
        raise ThdValueError(
            f"thd attention: this attention function was registered with a CP group, so every forward "
            f"needs the '{LAYOUT_KWARG}' kwarg: call the model with the inputs of "
            "thd.integrations.transformers.shard_batch(batch, group)"
        )
    _check_cp_size(layout.cp_size, group)
    extra = feature_kwargs(causal=causal, **features)
    out = ring_attention(
        q,
        k,
        v,
        layout.cu_seqlens,
        layout.cu_seqlens,
        layout.cu_seqlens_padded,
        layout.cu_seqlens_padded,
        group=group,
        causal=causal,
        softmax_scale=scale,
        pad_between_seqs=layout.pad_between_seqs,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
        **extra,
    )
    assert isinstance(out, Tensor)
    return out


def make_attention_function(group: dist.ProcessGroup | None = None) -> AttentionFn:
    """The function to register; with ``group`` it runs ring attention over that CP group."""

    def thd_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        s_aux: Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        check_unsupported(dropout, kwargs)
        causal = _is_causal(module, is_causal)
        batch, heads, q_len, _ = query.shape
        features = {"sliding_window": sliding_window, "softcap": softcap, "sinks": s_aux}
        q, k, v = _rows(query), _rows(key), _rows(value)
        if group is not None:
            if attention_mask is not None:
                raise ThdValueError(
                    "thd attention: context-parallel batches are packed and take no attention_mask; "
                    "pass the inputs of shard_batch(batch, group)"
                )
            out = _ring(
                q, k, v, kwargs.get(LAYOUT_KWARG), group, causal=causal, scale=scaling, features=features
            )
        else:
            layout = resolve_layout(attention_mask, batch, q_len, key.shape[2], query.device, kwargs)
            out = _local(q, k, v, layout, causal=causal, scale=scaling, features=features)
        return out.view(batch, q_len, heads, out.shape[-1]), None

    return thd_attention_forward
