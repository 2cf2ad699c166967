"""One launch of a ring plan: the unchecked forward / backward of :mod:`thd.ops.attention.dispatch`
on the launch's layout, causal flag and sinks. :mod:`thd.cp.ring` folds these per step and
exchange; :mod:`thd.cp.reference` runs the same launches without communication."""

from __future__ import annotations

from torch import Tensor

from thd.cp.plan import Launch
from thd.ops.attention.dispatch import backward_call, forward_call
from thd.ops.attention.params import AttentionOptions, BackwardCall, ForwardCall, SavedForBackward

__all__ = ["launch_backward", "launch_forward"]


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
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dsinks)`` of one launch from the merged ``out`` and ``lse``; ``dsinks``
    (over the launch's real query rows) only when it carries the sinks. With
    ``accumulate=(dq, dk, dv)`` (fp32) the gradients are added into those buffers instead."""
    q, k, v, out, lse, sinks = saved
    carried = SavedForBackward(q, k, v, out, lse, sinks if launch.sinks else None)
    return backward_call(BackwardCall(do, carried, launch.layout, launch.launch_options(options), accumulate))
