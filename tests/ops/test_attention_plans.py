"""The ``tl`` family's cached launch plans: a call served from a plan launches exactly what the
argument builders give for it, a plan never outlives what it depends on (offset lengths, bounds,
strides, options, the tile table), and the offsets a call passes (changed in place after a cached
call, or new tensors of the cached length) are what the kernels read (checked against the torch
reference through the interpreter)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import thd
from thd._runtime import config, tiles
from thd.ops.attention import launch
from thd.ops.attention.params import (
    AttentionOptions,
    BackwardCall,
    ForwardCall,
    SavedForBackward,
    VarlenLayout,
)

pytestmark = pytest.mark.skipif(
    not config.interpreting(), reason="the tl kernels on CPU need TRITON_INTERPRET=1"
)


class _Recorder:
    """Stands in for a KernelLauncher: records each launch, then makes it."""

    def __init__(self, real: Any, seen: list) -> None:
        self.real, self.seen = real, seen
        self.fixed = 0  # launches of a reused plan (through run_fixed)

    def run(self, grid: tuple, *args: Any, **kwargs: Any) -> Any:
        self.seen.append((self.real.fn, grid, args, kwargs))
        return self.real.run(grid, *args, **kwargs)

    def run_fixed(self, token: object, grid: tuple, head: tuple, tail: tuple, kwargs: dict) -> Any:
        self.seen.append((self.real.fn, grid, (*head, *tail), kwargs))
        self.fixed += 1
        return self.real.run_fixed(token, grid, head, tail, kwargs)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    seen: list = []
    recorders = {name: _Recorder(real, seen) for name, real in launch.LAUNCHERS.items()}
    monkeypatch.setattr(launch, "LAUNCHERS", recorders)
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("THD_KERNELS", "tl")
    launch.clear_plans()
    yield seen
    launch.clear_plans()


def _inputs(rows: int = 12, heads: int = 2, dim: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(rows, heads, dim, generator=gen) for _ in range(4))


def _expected_fwd(call: ForwardCall, out: torch.Tensor, lse: torch.Tensor) -> tuple[tuple, tuple]:
    """The grid and arguments the unplanned path computes (independently of the plan's cache)."""
    assert call.layout.max_seqlen_q is not None
    block = tiles.tile_for(
        "fwd", {"BLOCK_D": 16, "BLOCK_DV": 16, "FP32": True}, call.layout.max_seqlen_q
    ).block_m
    grid = (max(1, -(-call.layout.max_seqlen_q // block)), call.q.shape[1], call.layout.num_seqs + 1)
    return grid, launch.forward_args(call, out, lse)


def test_cached_forward_launches_what_the_builders_give(launches: list) -> None:
    q, k, v, _ = _inputs()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    options = AttentionOptions(softmax_scale=0.25, causal=True)
    for _ in range(3):  # one miss, then hits
        layout = VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7)  # a new object each call
        call = ForwardCall(q, k, v, layout, options)
        out, lse = launch.forward(call)
        _, grid, args, kwargs = launches[-1]
        assert args[3] is out and args[4] is lse
        assert (grid, args) == _expected_fwd(call, out, lse)
        assert kwargs["BLOCK_M"] == tiles.INTERPRETER_TILE.block_m and kwargs["HAS_SINKS"] is False
    assert launch.plan_counts() == (1, 0) and len(launches) == 3


def test_cached_backward_launches_what_the_builders_give(launches: list) -> None:
    q, k, v, do = _inputs()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    layout = VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7)
    options = AttentionOptions(softmax_scale=0.25, causal=True, deterministic=True)  # dQ by its own kernel
    out, lse = launch.forward(ForwardCall(q, k, v, layout, options))
    for _ in range(2):
        del launches[:]
        dq, dk, dv, _ = launch.backward(
            BackwardCall(do, SavedForBackward(q, k, v, out, lse), layout, options)
        )
        names = [fn.__name__ for fn, *_ in launches]
        assert names == [
            "_attention_bwd_preprocess_kernel",
            "_attention_bwd_dkdv_kernel",
            "_attention_bwd_dq_kernel",
        ]
        _, pre_grid, pre_args, _ = launches[0]
        delta = pre_args[2]
        assert pre_args == launch.preprocess_args(out, do, delta, lse, None, None, layout)
        assert pre_grid == (1, 2, 2)
        inputs = (q, k, v, do, lse, delta)
        assert launches[1][2] == launch.backward_args(inputs, (dk, dv, dq), layout, options)
        assert launches[2][2] == launch.backward_args(inputs, (dq,), layout, options)
    assert launch.plan_counts() == (1, 1)


def _check_against_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, offsets: torch.Tensor
) -> None:
    """``thd.attention`` (forward and gradients) with ``offsets`` for both sides, causal, against
    the torch reference."""
    bounds = {"max_seqlen_q": 9, "max_seqlen_kv": 9, "causal": True}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = thd.attention(*leaves, offsets, offsets, **bounds)
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = thd.reference.attention(*ref_leaves, offsets.clone(), offsets.clone(), causal=True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_offsets_changed_in_place_after_a_cached_call(launches: list) -> None:
    """In-place refills keep the plan (it never depends on the values) and the kernels read the new
    offsets; a resize (other lengths) is a new plan. Outputs against the reference."""
    q, k, v, do = _inputs()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def check(offsets: torch.Tensor) -> None:
        _check_against_reference(q, k, v, do, offsets)

    check(cu)
    assert launch.plan_counts() == (1, 1)
    cu.copy_(torch.tensor([0, 9, 12], dtype=torch.int32))  # new values, same tensor: same plans
    check(cu)
    assert launch.plan_counts() == (1, 1)
    cu.resize_(4).copy_(torch.tensor([0, 3, 4, 12], dtype=torch.int32))  # same tensor, one more sequence
    check(cu)
    assert launch.plan_counts() == (2, 2)
    check(torch.tensor([0, 3, 4, 12], dtype=torch.int32))  # a new tensor of that length: same plans
    assert launch.plan_counts() == (2, 2)


def test_new_offsets_tensors_reuse_the_cached_plans(launches: list) -> None:
    """A new offsets tensor per call (a data loader's batch, the ring's layouts) of the cached
    length finds the cached plans, launches through ``run_fixed`` with its own offsets, and the
    kernels read its values: other document boundaries give other, correct outputs."""
    q, k, v, do = _inputs()
    calls = [[0, 5, 12], [0, 9, 12], [0, 2, 12], [0, 5, 12]]  # two documents, boundaries moving
    outputs = []
    for step, values in enumerate(calls):
        fixed = sum(recorder.fixed for recorder in launch.LAUNCHERS.values())
        del launches[:]
        offsets = torch.tensor(values, dtype=torch.int32)  # a new tensor each call
        _check_against_reference(q, k, v, do, offsets)
        assert launch.plan_counts() == (1, 1)
        assert len(launches) >= 3  # forward, preprocess, dK/dV (and dQ unless by atomics) ...
        for _, _, args, _ in launches:
            assert any(a is offsets for a in args)  # ... each with this call's offsets
        if step:  # ... from the cached plans
            assert sum(recorder.fixed for recorder in launch.LAUNCHERS.values()) - fixed == len(launches)
        outputs.append(thd.attention(q, k, v, offsets, offsets, max_seqlen_q=9, max_seqlen_kv=9, causal=True))
        assert launch.plan_counts() == (1, 1), step
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[1], outputs[2])
    assert torch.equal(outputs[0], outputs[3])


def test_new_plan_for_another_offsets_length_or_optional_tensor(launches: list) -> None:
    """What shapes the launch gets a plan of its own: another offsets length (the grid), padded
    slots or positions given where the cached call had none (the kernels' positions switch)."""
    q, k, v, _ = _inputs()
    options = AttentionOptions(softmax_scale=0.25, causal=True)

    def forward(cu: list[int], **optional: torch.Tensor) -> None:
        offsets = torch.tensor(cu, dtype=torch.int32)
        layout = VarlenLayout(offsets, offsets.clone(), max_seqlen_q=7, max_seqlen_kv=7, **optional)
        call = ForwardCall(q, k, v, layout, options)
        out, lse = launch.forward(call)
        assert launches[-1][2] == launch.forward_args(call, out, lse)

    forward([0, 5, 12])
    forward([0, 6, 12])
    assert launch.plan_counts() == (1, 0)
    forward([0, 3, 6, 12])
    assert launch.plan_counts() == (2, 0)
    forward([0, 5, 12], cu_seqlens_q_padded=torch.tensor([0, 5, 12], dtype=torch.int32))
    assert launch.plan_counts() == (3, 0)
    positions = torch.tensor([0, 2], dtype=torch.int32)
    forward([0, 5, 12], positions_q=positions, positions_kv=positions)
    assert launch.plan_counts() == (4, 0)
    forward([0, 5, 12], positions_q=positions.clone(), positions_kv=positions.clone())
    assert launch.plan_counts() == (4, 0)


def test_plan_follows_the_tile_table_and_bounds(launches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, _ = _inputs()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    options = AttentionOptions(softmax_scale=0.25)
    launch.forward(ForwardCall(q, k, v, VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7), options))
    monkeypatch.setattr(tiles, "INTERPRETER_TILE", tiles.Tile(16, 16, 4, 1))  # the tuner changes tiles too
    launch.forward(ForwardCall(q, k, v, VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7), options))
    assert launches[-1][3]["BLOCK_M"] == 16 and launches[-1][1] == (1, 2, 3)
    launch.forward(ForwardCall(q, k, v, VarlenLayout(cu, cu, max_seqlen_q=40, max_seqlen_kv=40), options))
    assert launches[-1][1] == (3, 2, 3)  # another bound: another grid
    strided = torch.randn(12, 2, 2, 16)[:, :, 0]  # row-major rows, other strides
    call = ForwardCall(strided, k, v, VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7), options)
    out, lse = launch.forward(call)
    assert launches[-1][2] == launch.forward_args(call, out, lse)


def test_plans_are_bounded(launches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "PLAN_LIMIT", 2)
    q, k, v, _ = _inputs(rows=4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    options = AttentionOptions(softmax_scale=0.25)
    for bound in (1, 2, 3):
        launch.forward(
            ForwardCall(q, k, v, VarlenLayout(cu, cu, max_seqlen_q=bound, max_seqlen_kv=4), options)
        )
    assert launch.plan_counts() == (1, 0)  # the third plan found the cache full and dropped it


def test_zero_scale_plans_are_not_kept(launches: list) -> None:
    """0.0 and -0.0 are equal options but not one scale: a call with either launches its own."""
    q, k, v, _ = _inputs()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    at = launch.FWD_ARGS.index("sm_scale")
    for scale in (0.0, -0.0, 0.0):
        call = ForwardCall(
            q, k, v, VarlenLayout(cu, cu, max_seqlen_q=7, max_seqlen_kv=7), AttentionOptions(scale)
        )
        launch.forward(call)
        assert math.copysign(1.0, launches[-1][2][at]) == math.copysign(1.0, scale)
    assert launch.plan_counts() == (0, 0)
