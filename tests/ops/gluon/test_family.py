"""``thd.ops.attention.gluon.family`` on CPU tensors: the family never claims a call it cannot run
(no GPU, interpreter), and ``auto`` prefers it only where it measured faster than tl."""

from __future__ import annotations

import torch

from thd.ops.attention.gluon import family
from thd.ops.attention.params import (
    AttentionOptions,
    BackwardCall,
    ForwardCall,
    SavedForBackward,
    VarlenLayout,
)


def _calls(dim: int, max_seqlen: int | None = 7) -> tuple[ForwardCall, BackwardCall]:
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 2, dim, dtype=torch.bfloat16) for _ in range(3))
    layout = VarlenLayout(cu, cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    options = AttentionOptions(dim**-0.5, causal=True)
    lse = torch.zeros(2, 12)
    saved = SavedForBackward(q, k, v, torch.zeros_like(q), lse)
    return ForwardCall(q, k, v, layout, options), BackwardCall(torch.zeros_like(q), saved, layout, options)


def test_cpu_calls_are_not_supported() -> None:
    for dim in (64, 128):
        forward, backward = _calls(dim)
        assert not family.supports_forward(forward)
        assert not family.supports_backward(backward)


def test_auto_preference_follows_the_measurements() -> None:
    for dim in (64, 128):
        forward, backward = _calls(dim)
        assert not family.auto_forward(forward)  # short documents: tl measured faster
        assert not family.auto_backward(backward)
        # the backward: head dims 64 and 128 and a stated max_seqlen_q above 1024 tokens
        assert family.auto_backward(_calls(dim, max_seqlen=1025)[1])
        assert not family.auto_backward(_calls(dim, max_seqlen=1024)[1])
        assert not family.auto_backward(_calls(dim, max_seqlen=None)[1])
    assert family.AUTO_BACKWARD_HEAD_DIMS == (64, 128)
    assert not family.auto_backward(_calls(32, max_seqlen=8192)[1])
    # the forward: a stated max_seqlen_q above 512 tokens at head dim 128, above 4096 at 64
    assert family.auto_forward(_calls(128, max_seqlen=513)[0])
    assert family.auto_forward(_calls(128, max_seqlen=1004)[0])  # the measured 64-1024 row's longest
    assert not family.auto_forward(_calls(128, max_seqlen=512)[0])
    assert not family.auto_forward(_calls(128, max_seqlen=None)[0])  # unknown: never read back
    assert family.auto_forward(_calls(64, max_seqlen=4097)[0])
    assert not family.auto_forward(_calls(64, max_seqlen=4096)[0])
    assert not family.auto_forward(_calls(64, max_seqlen=None)[0])
    assert not family.auto_forward(_calls(256, max_seqlen=65536)[0])  # d256: tl measured faster
    assert not family.auto_forward(_calls(32, max_seqlen=65536)[0])
    mixed, _ = _calls(128, max_seqlen=8192)
    v64 = mixed.v[..., :64]
    assert not family.auto_forward(mixed._replace(v=v64))  # D != Dv: no measurement, tl


def test_auto_keeps_softcap_forwards_on_tl_and_takes_their_gluon_backward() -> None:
    """Measured with softcap 50 (H100): the Gluon forward 0.97x / 0.67x tl at head dim 128 / 64,
    its backward faster than tl's at both."""
    for dim in (64, 128):
        forward, backward = _calls(dim, max_seqlen=8192)
        capped = AttentionOptions(dim**-0.5, causal=True, softcap=50.0)
        assert family.auto_forward(forward) and not family.auto_forward(forward._replace(options=capped))
        assert family.auto_backward(backward._replace(options=capped))
