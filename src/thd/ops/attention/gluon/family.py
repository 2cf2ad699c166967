"""The Gluon kernels as a kernel family of the attention op (see :mod:`thd._runtime.families`).

Each entry takes one typed call (:class:`ForwardCall` / :class:`BackwardCall`); the launches and
their ``supports_*`` are :mod:`~thd.ops.attention.gluon.forward`'s and
:mod:`~thd.ops.attention.gluon.backward`'s own.
``supports_*`` say whether the family can run a call (``THD_KERNELS=gluon`` runs it then);
``auto_*`` whether ``THD_KERNELS=auto`` should prefer it over ``tl`` for a supported call, from
what was measured on the H200 in the same runs as tl (benchmarks/results/gluon-fwd-*.json,
gluon-bwd-*.json): the Gluon forward (K and V released apart, since 2d97471) ran at 1.05-1.16x
tl's TFLOP/s at head dim 128 on documents of up to 4096 and 8192 tokens, but 0.85-0.90x on documents
of 64-1024 tokens and 0.93-1.05x at head dim 64, so ``auto`` took it at head dim 128 when the call
stated ``max_seqlen_q`` above 1024 (a host value: nothing is read from the device to decide). With
its output staged through shared memory (cdab947) it ran at 1.08x tl on 64-1024-token documents
(longest 1004; 256 against 238 TFLOP/s, H100, attention-cdab947-h100.json), so ``auto`` now takes
it at head dim 128 above a stated 512 (nothing shorter was measured). With
its per-tile work order (88ed81f) the head-dim-64 forward ran at 1.02-1.13x tl on documents of up to
8192 tokens and longer, but 0.96x on 256-4096 and 0.42x on 64-1024 (H100, attention-9028dd2-h100.json),
so ``auto`` takes it at head dim 64 above 4096 (:data:`AUTO_FORWARD_MIN_SEQLEN`); the
Gluon backward (two consumer partitions, dQ by TMA reduce-add) took 0.72x tl's time at head dim
128 and 0.85x at 64 on 512-8192-token documents (gluon-bwd-stats-smem-df281ed.json; 0.82x / 0.89x
before, gluon-bwd-atomic-5263879.json) and about 0.9x on 256-4096 (before), but 1.16x at 128 and
2.1x at 64 on 64-1024-token documents (attention-45baae4.json, backward time derived from the
forward and forward+backward records, before that change), so ``auto`` takes it at both head dims
under the forward's rule on the stated ``max_seqlen_q``.
With softcap the Gluon forward ran at 0.97x tl at head dim 128 and 0.67x at 64 (softcap 50, 32k of
512-8192, H100, attention-softcap-71672bc-h100.json; 0.97x / 0.68x in attention-variants-9fe89b8-h100.json),
so ``auto`` keeps softcap forwards on tl; the Gluon backward with softcap is ``auto``'s under the rule above
(forward+backward, Gluon both ways: 1.14x / 1.18x tl's).
"""

from __future__ import annotations

from thd.ops.attention.gluon import backward as gluon_backward
from thd.ops.attention.gluon import forward as gluon_forward
from thd.ops.attention.params import BackwardCall, ForwardCall

__all__ = ["auto_backward", "auto_forward", "backward", "forward", "supports_backward", "supports_forward"]

AUTO_BACKWARD_HEAD_DIMS = (64, 128)
"""Head dims whose Gluon backward measured faster than tl's (``auto`` picks it there)."""


supports_forward = gluon_forward.supports_forward
forward = gluon_forward.forward
supports_backward = gluon_backward.supports_backward
backward = gluon_backward.backward


AUTO_FORWARD_MIN_SEQLEN = {128: 512, 64: 4096}
"""Head dim (``q`` and ``v`` alike) -> the stated ``max_seqlen_q`` above which ``auto`` takes the
Gluon forward (module docstring); head dims not named stay on tl."""
AUTO_MIN_SEQLEN = 1024
"""``auto`` takes the Gluon backward only when the call's ``max_seqlen_q`` is above this."""


def auto_forward(call: ForwardCall) -> bool:
    """A stated ``max_seqlen_q`` above :data:`AUTO_FORWARD_MIN_SEQLEN` of the call's head dim, the
    same for ``q`` and ``v``, and no softcap (module docstring)."""
    if call.options.softcap > 0.0:
        return False
    longest = call.layout.max_seqlen_q
    head_dim = call.q.shape[2]
    threshold = AUTO_FORWARD_MIN_SEQLEN.get(head_dim) if call.v.shape[2] == head_dim else None
    return threshold is not None and longest is not None and longest > threshold


def auto_backward(call: BackwardCall) -> bool:
    """Head dims 64 and 128 and a stated ``max_seqlen_q`` above 1024 (module docstring)."""
    longest = call.layout.max_seqlen_q
    dims_ok = call.saved.q.shape[2] in AUTO_BACKWARD_HEAD_DIMS
    return dims_ok and longest is not None and longest > AUTO_MIN_SEQLEN
