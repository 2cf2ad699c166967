"""Public varlen attention: validation, backend dispatch, custom ops and autograd.

``attention_forward`` / ``attention_backward`` are the low-level entry points (used by the
context-parallel ring); :func:`attention` is the differentiable public API, registered as
the custom ops ``thd::attention_fwd`` / ``thd::attention_bwd`` so that ``torch.compile``
traces it without graph breaks and CUDA graphs can capture it.

Backend choice: CUDA tensors run the Triton kernels; CPU tensors run the torch reference,
except under ``TRITON_INTERPRET=1`` where they run the Triton kernels through the
interpreter. ``THD_ATTENTION_BACKEND=reference|triton`` forces one.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from thd._capture import is_capturing
from thd._triton import runs_triton
from thd.errors import ThdTypeError, ThdValueError
from thd.layout import check_cu_metadata
from thd.layout import validate as validate_layout
from thd.ops.attention import launch, reference
from thd.ops.attention.checks import check_accumulator, check_qkv
from thd.ops.lse_merge.reference import merge_partials_reference

__all__ = ["SUPPORTED_HEAD_DIMS", "AttentionFunction", "attention", "attention_backward", "attention_forward"]

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def _use_triton(x: Tensor) -> bool:
    forced = os.environ.get("THD_ATTENTION_BACKEND", "").lower()
    if forced in ("reference", "triton"):
        return forced == "triton"
    return runs_triton(x)


def _validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_kv: Tensor,
    cup_q: Tensor | None,
    cup_kv: Tensor | None,
) -> None:
    """Metadata checks only (shapes, dtypes, devices): they never read device memory."""
    fn = "attention"
    check_qkv(fn, q, k, v)
    if q.dtype == torch.float64:
        raise ThdTypeError(f"{fn}: q dtype: expected fp16/bf16/fp32, got {q.dtype}")
    for name, dim in (("q/k head_dim", q.shape[2]), ("v head_dim", v.shape[2])):
        if dim not in SUPPORTED_HEAD_DIMS:
            raise ThdValueError(f"{fn}: {name}: expected one of {SUPPORTED_HEAD_DIMS}, got {dim}")
    check_cu_metadata(fn, cu_q, cup_q, names=("cu_seqlens_q", "cu_seqlens_q_padded"))
    check_cu_metadata(fn, cu_kv, cup_kv, names=("cu_seqlens_kv", "cu_seqlens_kv_padded"))
    if cu_kv.shape != cu_q.shape:
        raise ThdValueError(
            f"{fn}: cu_seqlens_kv shape: expected {list(cu_q.shape)} (as cu_seqlens_q), "
            f"got {list(cu_kv.shape)}"
        )
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        if t.device != q.device:
            raise ThdValueError(f"{fn}: {name} device: expected {q.device} (as q), got {t.device}")


def _resolve_max_seqlen(name: str, cu: Tensor, given: int | None) -> int:
    if given is not None:
        return int(given)
    if is_capturing():
        raise ThdValueError(
            f"attention: {name} is None during CUDA-graph capture; pass the maximum real "
            "sequence length as an int (deriving it needs a device-to-host read)"
        )
    if cu.numel() < 2:
        return 0
    return int((cu[1:] - cu[:-1]).max().item())


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_kv: int | None,
    causal: bool,
    softmax_scale: float,
    accumulate: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Low-level forward (no autograd): ``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)``.

    Non-real query rows get exact zeros in ``out`` and ``-inf`` in ``lse``. With
    ``accumulate=(out, lse)``, a normalised partial result over other keys, this call's keys
    are merged into it in place (log-sum-exp; only this call's real query rows change) and
    it is returned.
    """
    if accumulate is not None:
        check_accumulator("attention_forward", q, v, *accumulate)
    if not _use_triton(q):
        part = reference.attention_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            causal,
            softmax_scale,
        )
        if accumulate is None:
            return part
        return _merge_into(accumulate, part)
    return launch.forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        _resolve_max_seqlen("max_seqlen_q", cu_seqlens_q, max_seqlen_q),
        causal,
        softmax_scale,
        accumulate,
    )


def _merge_into(acc: tuple[Tensor, Tensor], part: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Reference accumulation: the log-sum-exp merge of ``acc`` and ``part``, written into ``acc``."""
    out, lse = acc
    merged_out, merged_lse = merge_partials_reference([acc, part], out.dtype)
    out.copy_(merged_out)
    lse.copy_(merged_lse)
    return out, lse


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_kv: int | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Low-level backward from saved ``out``/``lse`` (possibly merged by a ring).

    Returns ``(dq, dk, dv)`` with exact zeros on padding rows. The Triton backward uses
    no atomics, so it is always deterministic; ``deterministic`` is accepted for API
    compatibility.
    """
    del deterministic
    if not _use_triton(q):
        return reference.attention_backward(
            do,
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            causal,
            softmax_scale,
        )
    return launch.backward(
        do,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        _resolve_max_seqlen("max_seqlen_q", cu_seqlens_q, max_seqlen_q),
        _resolve_max_seqlen("max_seqlen_kv", cu_seqlens_kv, max_seqlen_kv),
        causal,
        softmax_scale,
    )


@torch.library.custom_op("thd::attention_fwd", mutates_args=())
def _attention_fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    return attention_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        max_seqlen_q,
        max_seqlen_kv,
        causal,
        softmax_scale,
    )


@_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
      max_seqlen_q, max_seqlen_kv, causal, softmax_scale):  # fmt: skip
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("thd::attention_bwd", mutates_args=())
def _attention_bwd_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return attention_backward(
        do,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        max_seqlen_q,
        max_seqlen_kv,
        causal,
        softmax_scale,
    )


@_attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
      cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, causal, softmax_scale):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, cu_q, cu_kv, cup_q, cup_kv, max_q, max_kv, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, cup_q, cup_kv)
    ctx.max_seqlens = (max_q, max_kv)
    ctx.causal = causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _grads_from_ctx(ctx, dout: Tensor, backward_fn) -> tuple:  # type: ignore[no-untyped-def]
    """Gradients of the 11 forward inputs from the saved context (lse carries no gradient)."""
    q, k, v, out, lse, cu_q, cu_kv, cup_q, cup_kv = ctx.saved_tensors
    dq, dk, dv = backward_fn(
        dout, q, k, v, out, lse, cu_q, cu_kv, cup_q, cup_kv,
        ctx.max_seqlens[0], ctx.max_seqlens[1], ctx.causal, ctx.scale,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None, None


def _backward(ctx, dout: Tensor, dlse: Tensor | None):  # type: ignore[no-untyped-def]
    del dlse  # lse is an auxiliary output; it carries no gradient
    return _grads_from_ctx(ctx, dout.contiguous(), _attention_bwd_op)


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class AttentionFunction(torch.autograd.Function):
    """Eager autograd path: the same computation as the custom ops, with less dispatch cost."""

    @staticmethod
    def forward(ctx, *inputs):  # type: ignore[no-untyped-def]
        out, lse = attention_forward(*inputs)
        _setup_context(ctx, inputs, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Tensor | None):  # type: ignore[no-untyped-def]
        del dlse
        return _grads_from_ctx(ctx, dout, attention_backward)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    *,
    cu_seqlens_q_padded: Tensor | None = None,
    cu_seqlens_kv_padded: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences (THD layout).

    Args:
        q: ``[Tq, Hq, D]`` queries (fp16/bf16 on GPU; fp32 too).
        k: ``[Tk, Hkv, D]`` keys, ``Hq % Hkv == 0`` (GQA/MQA).
        v: ``[Tk, Hkv, Dv]`` values; ``D, Dv`` in 32, 64, 96, 128, 192, 256.
        cu_seqlens_q: int32 ``[B+1]`` cumulative real query lengths.
        cu_seqlens_kv: int32 ``[B+1]`` cumulative real key lengths.
        cu_seqlens_q_padded: int32 ``[B+1]`` query slot offsets; sequence b's queries are
            rows ``[cu_seqlens_q_padded[b], cu_seqlens_q_padded[b] + Lq_b)``. None: no
            padding between slots (offsets equal ``cu_seqlens_q``).
        cu_seqlens_kv_padded: the same for keys/values.
        max_seqlen_q: largest real query length (any value works; a smaller one only costs
            time). Pass it to avoid a device-to-host read; it is required under CUDA-graph
            capture. When either bound is omitted, the read it costs also validates the
            layouts' values (:func:`thd.layout.validate`); with both given, call
            :func:`thd.layout.validate` yourself once per batch.
        max_seqlen_kv: largest real key length (same rules).
        causal: bottom-right aligned causal mask: query i sees key j iff
            ``j <= i + Lk_b - Lq_b``.
        softmax_scale: defaults to ``D ** -0.5``.
        return_lse: also return the log-sum-exp of the scores.
        deterministic: accepted; the backward is always deterministic (no atomics).

    Returns:
        ``out [Tq, Hq, Dv]`` in ``q.dtype`` and, with ``return_lse``, ``lse [Hq, Tq]`` fp32.
        Rows that are not real query rows (slot padding, tail, reserved capacity) hold
        exact zeros in ``out`` and ``-inf`` in ``lse``, as does a query that sees no key;
        their gradients are exact zeros. Padding rows of q, k, v are never read.

    Examples::

        >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32, device="cuda")
        >>> cup = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")
        >>> q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16)
        >>> out = thd.attention(q, q, q, cu, cu, cu_seqlens_q_padded=cup,
        ...                     cu_seqlens_kv_padded=cup, max_seqlen_q=3, max_seqlen_kv=3,
        ...                     causal=True)
    """
    del deterministic
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    if (max_seqlen_q is None or max_seqlen_kv is None) and not is_capturing():
        # A device-to-host read is paid here anyway: check the layouts' values with it.
        validate_layout(cu_seqlens_q, cu_seqlens_q_padded, num_rows=q.shape[0])
        validate_layout(cu_seqlens_kv, cu_seqlens_kv_padded, num_rows=k.shape[0])
    max_q = _resolve_max_seqlen("max_seqlen_q", cu_seqlens_q, max_seqlen_q)
    max_kv = _resolve_max_seqlen("max_seqlen_kv", cu_seqlens_kv, max_seqlen_kv)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
            max_q, max_kv, bool(causal), scale)  # fmt: skip
    # torch.compile traces the registered custom op (no graph break); eager mode takes the
    # autograd.Function, whose Python dispatch is several times cheaper.
    if torch.compiler.is_compiling():
        out, lse = _attention_fwd_op(*args)
    else:
        out, lse = AttentionFunction.apply(*args)
    return (out, lse) if return_lse else out
