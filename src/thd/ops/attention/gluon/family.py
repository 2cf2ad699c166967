"""The Gluon kernels as a kernel family of the attention op (see :mod:`thd._runtime.families`).

Each entry takes one typed call (:class:`ForwardCall` / :class:`BackwardCall`); the launches and
their ``supports_*`` are :mod:`~thd.ops.attention.gluon.forward`'s and
:mod:`~thd.ops.attention.gluon.backward`'s own.
``supports_*`` say whether the family can run a call (``THD_KERNELS=gluon`` runs it then);
``auto_*`` whether ``THD_KERNELS=auto`` should prefer it over ``tl`` for a supported call, from
what was measured on the H200 (benchmarks/results/gluon-fwd.json, gluon-bwd-run2.json): the
Gluon forward ran at 0.86-0.99x the tl forward on every measured workload, so ``auto`` keeps tl
for the forward; the Gluon backward took 0.90x tl's time at head dim 128 and 1.17x at 64, so
``auto`` takes it at 128 only.
"""

from __future__ import annotations

from thd.ops.attention.gluon import backward as gluon_backward
from thd.ops.attention.gluon import forward as gluon_forward
from thd.ops.attention.params import BackwardCall, ForwardCall

__all__ = ["auto_backward", "auto_forward", "backward", "forward", "supports_backward", "supports_forward"]

AUTO_BACKWARD_HEAD_DIMS = (128,)
"""Head dims whose Gluon backward measured faster than tl's (``auto`` picks it there)."""


supports_forward = gluon_forward.supports_forward
forward = gluon_forward.forward
supports_backward = gluon_backward.supports_backward
backward = gluon_backward.backward


def auto_forward(call: ForwardCall) -> bool:
    """Never: the tl forward measured faster everywhere (module docstring)."""
    del call
    return False


def auto_backward(call: BackwardCall) -> bool:
    return call.saved.q.shape[2] in AUTO_BACKWARD_HEAD_DIMS
