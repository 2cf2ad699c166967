"""One launch of a ring plan: the unchecked forward / backward of :mod:`thd.ops.attention.dispatch`
on the launch's layout, causal flag and sinks. :mod:`thd.cp.ring` folds these per step and
exchange; :mod:`thd.cp.reference` runs the same launches without communication."""

from __future__ import annotations

from torch import Tensor

from thd.cp.plan import Launch, RingPlan
from thd.ops.attention.dispatch import backward_call, backward_delta, forward_call, runs_kernels
from thd.ops.attention.params import AttentionOptions, BackwardCall, ForwardCall, SavedForBackward

__all__ = ["launch_backward", "launch_forward", "query_rows_delta"]


def launch_forward(
    launch: Launch,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: AttentionOptions,
    sinks: Tensor | None,
    accumulate: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)`` of one launch, zeros / ``-inf`` outside its rows;
    with ``accumulate`` the launch is merged into that partial result in place instead.
    ``sinks`` is used only when the launch carries them."""
    carried = sinks if launch.sinks else None
    return forward_call(
        ForwardCall(q, k, v, launch.layout, launch.launch_options(options), carried, accumulate)
    )


def launch_backward(
    launch: Launch,
    do: Tensor,
    saved: SavedForBackward,
    options: AttentionOptions,
    accumulate: tuple[Tensor, Tensor, Tensor] | None = None,
    delta: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dsinks)`` of one launch from the merged ``out`` and ``lse``; ``dsinks``
    (over the launch's real query rows) only when it carries the sinks. With
    ``accumulate=(dq, dk, dv)`` (fp32) the gradients are added into those buffers instead;
    ``delta``: :func:`query_rows_delta` of the plan, shared by its launches."""
    q, k, v, out, lse, sinks = saved
    carried = SavedForBackward(q, k, v, out, lse, sinks if launch.sinks else None)
    call = BackwardCall(do, carried, launch.layout, launch.launch_options(options), accumulate, delta)
    return backward_call(call)


def query_rows_delta(plan: RingPlan, do: Tensor, saved: SavedForBackward) -> Tensor | None:
    """``rowsum(dO * out)`` over the rank's real query rows (``plan.query_rows``), computed once
    for every backward launch of the plan (None at cp = 1: one launch, its own preprocess)."""
    q, k, v, out, lse, _ = saved
    if plan.query_rows is None or not runs_kernels(q):  # the reference computes its own
        return None
    call = BackwardCall(do, SavedForBackward(q, k, v, out, lse), plan.query_rows, plan.options)
    return backward_delta(call)
