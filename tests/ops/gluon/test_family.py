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


def _strided(shape: tuple[int, int, int], order: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape`` tensor laid out in memory in ``order`` of its dims (outermost first)."""
    stored = torch.randn([shape[d] for d in order]).to(dtype)
    return stored.permute([order.index(d) for d in range(3)])


def _copy_engine_reads(t: torch.Tensor) -> bool:
    """The rule the kernels' descriptors need, written out: unit last stride, heads adjacent in a
    row, 16-byte aligned base and row stride."""
    row_bytes = t.stride(0) * t.element_size()
    return t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0 and row_bytes % 16 == 0


STRIDED_INPUTS = [
    *(((12, 2, 64), order) for order in ((0, 2, 1), (2, 1, 0), (1, 2, 0), (0, 1, 2))),
    ((12, 1, 128), (1, 2, 0)),
]


def test_backward_judges_strided_inputs_without_copying_them(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``supports_backward`` says for a tensor whose last stride is not 1 what the copy the
    backward would make reads like (the oracle: that copy, made here), and makes no copy itself;
    a tensor with unit last stride is judged as it is (heads further apart than D: refused)."""
    from thd.ops.attention.gluon import backward, host

    monkeypatch.setattr(host, "on_gluon_device", lambda t: True)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    layout = VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7)
    wide = torch.randn(12, 2, 128, dtype=torch.bfloat16)[..., :64]  # unit last stride, heads 128 apart
    inputs = [
        _strided(shape, order, dtype)
        for shape, order in STRIDED_INPUTS
        for dtype in (torch.bfloat16, torch.half)
    ]
    expected = [_copy_engine_reads(q if q.stride(-1) == 1 else q.contiguous()) for q in inputs]
    inputs.append(wide)
    expected.append(False)
    copies: list[torch.Tensor] = []
    original = torch.Tensor.contiguous
    monkeypatch.setattr(
        torch.Tensor, "contiguous", lambda t, *a, **k: copies.append(t) or original(t, *a, **k)
    )
    for q, readable in zip(inputs, expected, strict=True):
        saved = SavedForBackward(q, q, q, torch.zeros_like(q), torch.zeros(q.shape[1], 12))
        call = BackwardCall(torch.zeros_like(q), saved, layout, AttentionOptions(0.125, causal=True))
        assert backward.supports_backward(call) is readable, (q.shape, q.stride())
    assert copies == []
    assert any(q.stride(-1) != 1 for q in inputs) and any(expected)
