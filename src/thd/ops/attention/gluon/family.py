"""The Gluon kernels as a kernel family of the attention op (see :mod:`thd._runtime.families`).

Each entry takes one typed call (:class:`ForwardCall` / :class:`BackwardCall`) and hands its
fields to :mod:`~thd.ops.attention.gluon.forward` / :mod:`~thd.ops.attention.gluon.backward`.
``supports_*`` say whether the family can run a call (``THD_KERNELS=gluon`` runs it then);
``auto_*`` whether ``THD_KERNELS=auto`` should prefer it over ``tl`` for a supported call, from
what was measured on the H200 (benchmarks/results/gluon-fwd.json, gluon-bwd-run2.json): the
Gluon forward ran at 0.86-0.99x the tl forward on every measured workload, so ``auto`` keeps tl
for the forward; the Gluon backward took 0.90x tl's time at head dim 128 and 1.17x at 64, so
``auto`` takes it at 128 only.
"""

from __future__ import annotations

from torch import Tensor

from thd.ops.attention.gluon import backward as gluon_backward
from thd.ops.attention.gluon import forward as gluon_forward
from thd.ops.attention.params import BackwardCall, ForwardCall

__all__ = ["auto_backward", "auto_forward", "backward", "forward", "supports_backward", "supports_forward"]

AUTO_BACKWARD_HEAD_DIMS = (128,)
"""Head dims whose Gluon backward measured faster than tl's (``auto`` picks it there)."""


def _backward_args(call: BackwardCall) -> tuple:
    """The Gluon backward's positional arguments, in its order (the forward's are the
    :class:`ForwardCall` fields, in order)."""
    saved = call.saved
    return (
        call.do,
        saved.q,
        saved.k,
        saved.v,
        saved.out,
        saved.lse,
        call.layout,
        call.options,
        saved.sinks,
        call.accumulate,
    )


def supports_forward(call: ForwardCall) -> bool:
    return gluon_forward.supports_forward(*call)


def auto_forward(call: ForwardCall) -> bool:
    """Never: the tl forward measured faster everywhere (module docstring)."""
    del call
    return False


def forward(call: ForwardCall) -> tuple[Tensor, Tensor]:
    return gluon_forward.forward(*call)


def supports_backward(call: BackwardCall) -> bool:
    saved = call.saved
    return gluon_backward.supports_backward(
        *saved[:3], call.layout, call.options, saved.sinks, call.accumulate
    )


def auto_backward(call: BackwardCall) -> bool:
    return call.saved.q.shape[2] in AUTO_BACKWARD_HEAD_DIMS


def backward(call: BackwardCall) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    return gluon_backward.backward(*_backward_args(call))
