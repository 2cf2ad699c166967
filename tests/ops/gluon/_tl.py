"""The tl family and the reference called with the Gluon wrappers' positional arguments, so the
Gluon GPU tests compare like with like (both families run the same call)."""

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


def tl_backward(
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
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    saved = SavedForBackward(q, k, v, out, lse, sinks)
    return launch.backward(BackwardCall(do, saved, layout, options, accumulate))
