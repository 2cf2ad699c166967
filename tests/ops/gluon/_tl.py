"""The tl family and the reference called with positional arguments, and the typed backward call
of the same arguments, so the Gluon GPU tests compare like with like (both families run the same
call)."""

from __future__ import annotations

from torch import Tensor

from thd.ops.attention import launch, reference
from thd.ops.attention.params import (
    AttentionOptions,
    BackwardCall,
    ForwardCall,
    SavedForBackward,
    VarlenLayout,
)


def tl_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: VarlenLayout,
    options: AttentionOptions,
    sinks: Tensor | None = None,
    accumulate: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    return launch.forward(ForwardCall(q, k, v, layout, options, sinks, accumulate))


def reference_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: VarlenLayout,
    options: AttentionOptions,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    return reference.forward(ForwardCall(q, k, v, layout, options, sinks))


def backward_call(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout: VarlenLayout,
    options: AttentionOptions,
    sinks: Tensor | None = None,
    accumulate: tuple[Tensor, Tensor, Tensor] | None = None,
) -> BackwardCall:
    """The typed call of these positional arguments (the Gluon wrappers take it)."""
    return BackwardCall(do, SavedForBackward(q, k, v, out, lse, sinks), layout, options, accumulate)


def tl_backward(*args: object, **kwargs: object) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`thd.ops.attention.launch.backward` of :func:`backward_call`'s arguments."""
    return launch.backward(backward_call(*args, **kwargs))  # type: ignore[arg-type]
