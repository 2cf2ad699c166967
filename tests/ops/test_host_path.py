"""What the lean host path of ``thd.attention`` must keep: gradients without a materialized lse
gradient, autograd's version checks of the layout's tensors (each saved once) and the checks'
cached fast paths rejecting what the full checks reject (CPU, torch reference)."""

from __future__ import annotations

import inspect
from dataclasses import fields, replace

import pytest
import torch

import thd
from tests._helpers import make_layout, make_qkv
from thd._runtime import config
from thd.ops.attention import launch
from thd.ops.attention.params import AttentionOptions, ForwardCall, VarlenLayout

LAYOUT = make_layout("slots", [5, 1, 7], pad_q=[3, 0, 1], capacity_q=2)


def _inputs(dtype: torch.dtype = torch.float32) -> tuple:
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = make_qkv(LAYOUT, 4, 2, 16, 16, dtype, "cpu", generator=gen)
    return q, k, v, do, LAYOUT.kwargs()


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_gradients_when_only_out_is_used() -> None:
    """``return_lse=True`` with only ``out`` in the loss: the gradients the op gives alone (no lse
    gradient is made or needed)."""
    q, k, v, do, kw = _inputs()
    leaves = _leaves(q, k, v)
    out, lse = thd.attention(*leaves, **kw, causal=True, return_lse=True)
    got = torch.autograd.grad(out, leaves, do)
    plain = _leaves(q, k, v)
    want = torch.autograd.grad(thd.attention(*plain, **kw, causal=True), plain, do)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert not lse.requires_grad


def test_undefined_out_gradient_gives_zero_gradients() -> None:
    """An op after ``out`` that gives it no gradient (undefined, not zeros): q, k, v get zeros, as
    when autograd materialized them."""

    class Cut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):  # type: ignore[no-untyped-def]
            return x.sum() + y.sum()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return None, grad.expand(3)

    q, k, v, _, kw = _inputs()
    leaves = _leaves(q, k, v)
    y = torch.ones(3, requires_grad=True)
    out = thd.attention(*leaves, **kw, causal=True)
    grads = torch.autograd.grad(Cut.apply(out, y), [*leaves, y])
    for g, t in zip(grads[:3], leaves, strict=True):
        assert g is not None and g.shape == t.shape and not g.any()


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_kv_padded"])
def test_offsets_refilled_before_backward_are_refused(which: str) -> None:
    """Each layout tensor is saved (once) for autograd's version check: refilled in place between
    the forward and the backward, the backward refuses to run."""
    q, k, v, do, kw = _inputs()
    kw = {**kw, which: kw[which].clone()}
    leaves = _leaves(q, k, v)
    out = thd.attention(*leaves, **kw, causal=True)
    kw[which].add_(0)  # same values, new version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, leaves, do)


@pytest.mark.skipif(not config.interpreting(), reason="the tl kernels on CPU need TRITON_INTERPRET=1")
def test_every_plan_key_component_makes_its_own_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call differing from a cached one in a single component of the plan's key gets a plan of
    its own, which launches its own arguments (a component left out of the key fails here); new
    layout tensors of the same lengths and equal options find the cached plan and launch theirs."""
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("THD_KERNELS", "tl")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    pos = torch.tensor([0, 5], dtype=torch.int32)
    options = AttentionOptions(softmax_scale=0.25)
    base = ForwardCall(q, k, v, VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7), options)

    def strided() -> torch.Tensor:
        return torch.randn(12, 2, 2, 16, generator=gen)[:, :, 0]  # rows of 64 elements

    lay = base.layout
    half = tuple(t.to(torch.bfloat16) for t in (q, k, v))
    shorter = torch.tensor([0, 12], dtype=torch.int32)
    variants = {
        "cu_seqlens_q length": base._replace(layout=replace(lay, cu_seqlens_q=shorter)),
        "cu_seqlens_q_padded": base._replace(layout=replace(lay, cu_seqlens_q_padded=cu.clone())),
        "cu_seqlens_kv_padded": base._replace(layout=replace(lay, cu_seqlens_kv_padded=cu.clone())),
        "positions": base._replace(layout=replace(lay, positions_q=pos, positions_kv=pos)),
        "max_seqlen_q": base._replace(layout=replace(lay, max_seqlen_q=40)),
        "max_seqlen_kv": base._replace(layout=replace(lay, max_seqlen_kv=40)),
        "options": base._replace(options=AttentionOptions(softmax_scale=0.5)),
        "q strides": base._replace(q=strided()),
        "k strides": base._replace(k=strided()),
        "v strides": base._replace(v=strided()),
        "k shape": base._replace(k=k[:, :1], v=v[:, :1]),
        "dtype": base._replace(q=half[0], k=half[1], v=half[2]),
        "sinks": base._replace(sinks=torch.zeros(2)),
        "accumulate": base._replace(accumulate=(torch.zeros(12, 2, 16), torch.zeros(2, 12))),
        "out strides": base._replace(accumulate=(torch.zeros(12, 2, 32)[..., :16], torch.zeros(2, 12))),
        "lse strides": base._replace(accumulate=(torch.zeros(12, 2, 16), torch.zeros(2, 24)[:, :12])),
    }
    other = torch.tensor([0, 9, 12], dtype=torch.int32)
    with_positions = variants["positions"].layout
    same_plans = {
        "cu_seqlens_q": base._replace(layout=replace(lay, cu_seqlens_q=other)),
        "cu_seqlens_kv": base._replace(layout=replace(lay, cu_seqlens_kv=other.clone())),
        "positions_kv": base._replace(layout=replace(with_positions, positions_kv=pos.clone())),
        "equal options": base._replace(options=AttentionOptions(softmax_scale=0.25)),
    }
    launch.clear_plans()
    seen: list = []
    real = launch.LAUNCHERS["fwd"]

    class Recorder:
        def run(self, grid: tuple, *args: object, **kwargs: object) -> object:
            seen.append(args)
            return real.run(grid, *args, **kwargs)

        def run_fixed(self, token: object, grid: tuple, head: tuple, tail: tuple, kwargs: dict) -> object:
            seen.append((*head, *tail))
            return real.run_fixed(token, grid, head, tail, kwargs)

    monkeypatch.setitem(launch.LAUNCHERS, "fwd", Recorder())
    try:
        for call in (base, base):
            launch.forward(call)
        assert launch.plan_counts() == (1, 0)
        for count, (name, call) in enumerate(variants.items(), start=2):
            out, lse = launch.forward(call)
            assert launch.plan_counts() == (count, 0), name
            assert seen[-1] == launch.forward_args(call, out, lse), name
        for name, call in same_plans.items():
            out, lse = launch.forward(call)
            assert launch.plan_counts() == (count, 0), name
            assert seen[-1] == launch.forward_args(call, out, lse), name
    finally:
        launch.clear_plans()


def test_layout_init_takes_the_fields_in_order() -> None:
    """``VarlenLayout``'s ``__init__`` takes every field, positionally in field order
    (``schema.unflatten`` relies on it) and by name, with the fields' defaults."""
    names = [f.name for f in fields(VarlenLayout)]
    assert list(inspect.signature(VarlenLayout.__init__).parameters)[1:] == names
    values = [object() for _ in names]
    layout = VarlenLayout(*values)  # type: ignore[arg-type]
    assert [getattr(layout, name) for name in names] == values
    assert VarlenLayout(**dict(zip(names, values, strict=True))) == layout  # type: ignore[arg-type]
    short = VarlenLayout(values[0], values[1])  # type: ignore[arg-type]
    assert all(getattr(short, f.name) == f.default for f in fields(VarlenLayout)[2:])
    with pytest.raises(AttributeError):
        layout.max_seqlen_q = 3  # type: ignore[misc]
    assert replace(layout, max_seqlen_q=3).max_seqlen_q == 3
