"""Low-level entry points of the attention op: one call, no argument checks, the implementation
chosen per call among the reference and the kernel families (:data:`FAMILIES`).

:func:`forward_call` and :func:`backward_call` are what :func:`thd.attention`, its custom ops and
the context-parallel ring call once their arguments are checked (the ring checks its own and
builds every layout and accumulator). :func:`runs_kernels` says whether a call on a tensor would
take the kernels, :func:`kernel_choice` which family ran the latest call (benchmarks report it).

Families take one typed call (:class:`ForwardCall`, :class:`BackwardCall`): the reference
(:mod:`thd.ops.attention.reference`), ``tl`` (:mod:`thd.ops.attention.launch`, the default) and
``gluon`` (:mod:`thd.ops.attention.gluon.family`; on sm_90 devices ``auto`` takes it where it
imports, its ``supports_*`` accepts the call and its ``auto_*`` prefers it: where it measured
faster than tl). ``THD_KERNELS=tl|gluon`` forces one (see :mod:`thd._runtime.families` for the
rules, an unsupported forced family included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from thd._capture import is_capturing
from thd._runtime.families import Choice, FamilyRegistry, OptionalFamily
from thd.errors import ThdValueError
from thd.ops.attention import reference
from thd.ops.attention.params import BackwardCall, ForwardCall, VarlenLayout

__all__ = [
    "FAMILIES",
    "backward_call",
    "backward_delta",
    "forward_call",
    "kernel_choice",
    "resolve_max_seqlens",
    "runs_kernels",
]


def _load_tl():  # type: ignore[no-untyped-def]
    from thd.ops.attention import launch  # imports Triton: on first use only

    return launch


def _load_gluon():  # type: ignore[no-untyped-def]
    from thd.ops.attention.gluon import family  # imports Triton's Gluon: on first use only

    return family


_SM90: dict[int, bool] = {}


def _on_sm90(x: Tensor) -> bool:
    """Whether ``x`` lives on a compute-capability 9.0 GPU (cached per device)."""
    if not x.is_cuda:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    found = _SM90.get(index)
    if found is None:
        found = _SM90[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return found


FAMILIES = FamilyRegistry(
    op="attention",
    reference=reference,
    default_name="tl",
    load_default=_load_tl,
    optional={"gluon": OptionalFamily(load=_load_gluon, auto=_on_sm90)},
)


def runs_kernels(x: Tensor) -> bool:
    """Whether an attention call on ``x`` runs a kernel family (else the torch reference)."""
    return not FAMILIES.runs_reference("forward", x)


def kernel_choice(phase: str = "forward") -> Choice | None:
    """Which implementation ran the latest ``"forward"`` or ``"backward"`` call, and why."""
    return FAMILIES.last(phase)


def _max_seqlen(name: str, cu: Tensor, given: int | None) -> int:
    if given is not None:
        return int(given)
    if is_capturing():
        raise ThdValueError(
            f"attention: {name} is None during CUDA-graph capture; pass the maximum real "
            "sequence length as an int (deriving it needs a device-to-host read)"
        )
    if cu.numel() < 2 or cu.is_meta:  # meta tensors: shapes only, no lengths to read
        return 0
    return int((cu[1:] - cu[:-1]).max().item())


def resolve_max_seqlens(layout: VarlenLayout) -> VarlenLayout:
    """``layout`` with both ``max_seqlen_*`` ints (one device-to-host read per missing bound)."""
    if layout.max_seqlen_q is not None and layout.max_seqlen_kv is not None:
        return layout
    return layout.with_max_seqlens(
        _max_seqlen("max_seqlen_q", layout.cu_seqlens_q, layout.max_seqlen_q),
        _max_seqlen("max_seqlen_kv", layout.cu_seqlens_kv, layout.max_seqlen_kv),
    )


def forward_call(call: ForwardCall) -> tuple[Tensor, Tensor]:
    """Unchecked forward: ``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)``, or ``call.accumulate=(out, lse)``
    with this call's keys merged into it in place (see :func:`thd.ops.attention.attention_forward`)."""
    if FAMILIES.runs_reference("forward", call.q):
        return reference.forward(call)
    layout = call.layout
    if layout.max_seqlen_q is None or layout.max_seqlen_kv is None:
        call = call._replace(layout=resolve_max_seqlens(layout))
    return FAMILIES.choose("forward", call.q, call).forward(call)  # type: ignore[no-any-return]


def backward_call(call: BackwardCall) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Unchecked backward: ``(dq, dk, dv, dsinks)``, exact zeros on padding rows; with
    ``call.accumulate=(dq, dk, dv)`` (fp32, shaped like q, k, v) the gradients are added into those
    buffers on this layout's real rows only. ``torch.use_deterministic_algorithms`` implies
    ``options.deterministic``."""
    if not call.options.deterministic and torch.are_deterministic_algorithms_enabled():
        call = call._replace(options=call.options.with_deterministic())
    q = call.saved.q
    if call.delta is not None:
        _check_delta(call.delta, call.saved.lse)
    if FAMILIES.runs_reference("backward", q):
        return reference.backward(call)
    layout = call.layout
    if layout.max_seqlen_q is None or layout.max_seqlen_kv is None:
        call = call._replace(layout=resolve_max_seqlens(layout))
    return FAMILIES.choose("backward", q, call).backward(call)  # type: ignore[no-any-return]


def backward_delta(call: BackwardCall) -> Tensor:
    """``rowsum(dO * out)`` (fp32, shaped like ``lse``) on ``call.layout``'s real query rows (other
    rows unspecified), to pass as :attr:`BackwardCall.delta` to backward calls over those rows:
    one preprocess launch instead of one per call (the ring's steps). The tl kernels' preprocess
    computes it for either family (or the reference, where that runs); no device reads."""
    q = call.saved.q
    if FAMILIES.runs_reference("backward", q):
        return reference.backward_delta(call)
    layout = call.layout
    if layout.max_seqlen_q is None or layout.max_seqlen_kv is None:
        call = call._replace(layout=resolve_max_seqlens(layout))
    return _load_tl().backward_delta(call)  # type: ignore[no-any-return]


def _check_delta(delta: Tensor, lse: Tensor) -> None:
    like_lse = delta.dtype == torch.float32 and delta.shape == lse.shape and delta.device == lse.device
    if not like_lse or not delta.is_contiguous():
        raise ThdValueError(
            f"backward: delta must be contiguous float32 shaped like lse {tuple(lse.shape)} on {lse.device}; "
            f"got {delta.dtype} {tuple(delta.shape)} on {delta.device} (contiguous: {delta.is_contiguous()})"
        )
