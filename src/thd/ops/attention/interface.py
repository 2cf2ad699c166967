"""Public varlen attention: validation, custom ops and autograd.

``attention_forward`` / ``attention_backward`` are the checked low-level entry points; they take a
:class:`VarlenLayout` and :class:`AttentionOptions` (the ring calls the unchecked
:func:`~thd.ops.attention.dispatch.forward_call` / ``backward_call`` instead).
:func:`attention` is the differentiable public API. ``torch.compile`` traces it through the
custom ops ``thd::attention_fwd`` / ``thd::attention_bwd`` (no graph breaks, capturable), whose
schema :mod:`thd.ops.attention.schema` generates from the typed objects; eager mode takes
:class:`AttentionFunction`, whose Python dispatch is several times cheaper, or, when no gradient
can be recorded (``no_grad``, ``inference_mode``), calls the forward directly. Both share one
context setup and one backward body.

Backend choice (:mod:`thd.ops.attention.dispatch`): CUDA tensors run a kernel family; CPU tensors
run the torch reference, except under ``TRITON_INTERPRET=1`` where they run the Triton kernels
through the interpreter. ``THD_ATTENTION_BACKEND=reference|triton`` forces one, and
``THD_KERNELS=tl|gluon`` the kernel family.
"""

from __future__ import annotations

import torch
from torch import Tensor

from thd._capture import is_capturing
from thd.layout import check_layout_async
from thd.layout import validate as validate_layout
from thd.ops.attention import schema
from thd.ops.attention.arguments import check_call
from thd.ops.attention.checks import check_accumulator, check_saved_outputs
from thd.ops.attention.dispatch import backward_call, forward_call, resolve_max_seqlens
from thd.ops.attention.keywords import (
    ATTENTION_ARGS,
    AttentionArgs,
    Unpack,
    check_keywords,
    score_options,
)
from thd.ops.attention.params import (
    AttentionOptions,
    BackwardCall,
    ForwardCall,
    SavedForBackward,
    VarlenLayout,
)

__all__ = [
    "AttentionFunction",
    "AttentionOptions",
    "VarlenLayout",
    "attention",
    "attention_backward",
    "attention_forward",
]


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: VarlenLayout,
    options: AttentionOptions,
    *,
    sinks: Tensor | None = None,
    accumulate: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Low-level forward (no autograd): ``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)``.

    Non-real query rows get exact zeros in ``out`` and ``-inf`` in ``lse``. With
    ``accumulate=(out, lse)``, a normalised partial result over other keys, this call's keys
    are merged into it in place (log-sum-exp; only this call's real query rows change) and
    it is returned. ``sinks`` adds ``exp(sinks[h])`` to every real row's denominator.
    """
    check_call("attention_forward", q, k, v, layout, options, sinks)
    if accumulate is not None:
        check_accumulator("attention_forward", q, v, *accumulate)
    return forward_call(ForwardCall(q, k, v, layout, options, sinks, accumulate))


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout: VarlenLayout,
    options: AttentionOptions,
    *,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Low-level backward from saved ``out``/``lse`` (possibly merged by a ring).

    Returns ``(dq, dk, dv, dsinks)`` with exact zeros on padding rows (``dsinks`` is None
    without sinks). ``options.deterministic`` (or ``torch.use_deterministic_algorithms``)
    selects the bitwise-reproducible backward without atomics.
    """
    check_call("attention_backward", q, k, v, layout, options, sinks)
    check_saved_outputs("attention_backward", q, v, do, out, lse)
    return backward_call(BackwardCall(do, SavedForBackward(q, k, v, out, lse, sinks), layout, options))


# ----------------------------------------------------------------------------- custom ops
# Schemas, flattening and unflattening of the layout and options: thd.ops.attention.schema.


def _attention_fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, *flat: object
) -> tuple[Tensor, Tensor]:
    layout, options = schema.unflatten(flat)
    return forward_call(ForwardCall(q, k, v, layout, options, sinks))


def _attention_bwd_impl(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, sinks: Tensor | None, *flat: object
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)``; ``dsinks`` is empty without sinks (an op returns tensors only)."""
    layout, options = schema.unflatten(flat)
    saved = SavedForBackward(q, k, v, out, lse, sinks)
    dq, dk, dv, dsinks = backward_call(BackwardCall(do, saved, layout, options))
    return dq, dk, dv, q.new_empty(0) if dsinks is None else dsinks


_attention_fwd_op = torch.library.custom_op(
    "thd::attention_fwd", _attention_fwd_impl, mutates_args=(), schema=schema.FWD_SCHEMA
)
_attention_bwd_op = torch.library.custom_op(
    "thd::attention_bwd", _attention_bwd_impl, mutates_args=(), schema=schema.BWD_SCHEMA
)


@_attention_fwd_op.register_fake
def _(q, k, v, sinks, *flat):  # type: ignore[no-untyped-def]
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return out, lse


@_attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, sinks, *flat):  # type: ignore[no-untyped-def]
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


# ----------------------------------------------------------------------------- autograd
# Both paths save (q, k, v, out, lse, sinks) and the layout's tensors, and keep the layout's
# bounds and the options on the context: _save / _saved are the only places that know how.


def _save(ctx, saved: SavedForBackward, layout: VarlenLayout, options: AttentionOptions) -> None:  # type: ignore[no-untyped-def]
    # The layout's tensors are saved too, each once, for autograd's version checks (an offset
    # tensor refilled in place between forward and backward is an error).
    ctx.save_for_backward(*saved, *_distinct_tensors(layout))
    ctx.layout = layout
    ctx.options = options
    ctx.mark_non_differentiable(saved.lse)


def _distinct_tensors(layout: VarlenLayout) -> tuple[Tensor, ...]:
    """The layout's tensors, each once (the offsets often fill several of its fields)."""
    found: tuple[Tensor, ...] = ()
    for t in layout.tensors():
        if t is not None and all(t is not seen for seen in found):
            found += (t,)
    return found


def _saved(ctx) -> SavedForBackward:  # type: ignore[no-untyped-def]
    return SavedForBackward._make(ctx.saved_tensors[: len(SavedForBackward._fields)])


def _grads(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[no-untyped-def]
    """``(dq, dk, dv, dsinks)`` from the saved context, by the backward custom op."""
    saved = _saved(ctx)
    flat = schema.flatten(ctx.layout, ctx.options)
    dq, dk, dv, dsinks = _attention_bwd_op(dout.contiguous(), *saved, *flat)
    return dq, dk, dv, (dsinks if saved.sinks is not None else None)


def _op_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, sinks, *flat = inputs
    layout, options = schema.unflatten(flat)
    _save(ctx, SavedForBackward(q, k, v, *output, sinks), layout, options)


_NO_FLAT_GRADS = (None,) * len(schema.FLAT_NAMES)


def _op_backward(ctx, dout: Tensor, dlse: Tensor | None):  # type: ignore[no-untyped-def]
    del dlse  # lse is an auxiliary output; it carries no gradient
    return (*_grads(ctx, dout), *_NO_FLAT_GRADS)


_attention_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class AttentionFunction(torch.autograd.Function):
    """Eager autograd path: the same computation as the custom ops, with less dispatch cost."""

    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        layout: VarlenLayout,  # type: ignore[override]
        options: AttentionOptions,
    ) -> tuple[Tensor, Tensor]:
        out, lse = forward_call(ForwardCall(q, k, v, layout, options, sinks))
        _save(ctx, SavedForBackward(q, k, v, out, lse, sinks), layout, options)
        ctx.set_materialize_grads(False)  # no zero gradient is made for lse (nor for an unused out)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):  # type: ignore[no-untyped-def, override]
        del dlse  # lse is an auxiliary output; it carries no gradient
        saved = _saved(ctx)
        if dout is None:  # an undefined gradient of out: zeros, as autograd would have made them
            dout = torch.zeros_like(saved.out, memory_format=torch.contiguous_format)
        dq, dk, dv, dsinks = backward_call(BackwardCall(dout.contiguous(), saved, ctx.layout, ctx.options))
        return dq, dk, dv, (dsinks if saved.sinks is not None else None), None, None


def _no_gradients() -> bool:
    """Whether no gradient of any kind can be recorded now: grad mode off (``no_grad``,
    ``inference_mode``), no functorch transform active and no forward-AD dual level entered."""
    return (
        not torch.is_grad_enabled()
        and not _functorch_active()
        and getattr(torch.autograd.forward_ad, "_current_level", 0) < 0
    )


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


# ----------------------------------------------------------------------------- public API


def attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, **kw: Unpack[AttentionArgs]
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences (THD layout).

    The keywords below are typed once, by :class:`~thd.ops.attention.keywords.AttentionArgs`; one
    it does not take is a :class:`~thd.errors.ThdTypeError`.

    Args:
        q: ``[Tq, Hq, D]`` queries (fp16/bf16 on GPU; fp32 too).
        k: ``[Tk, Hkv, D]`` keys, ``Hq % Hkv == 0`` (GQA/MQA).
        v: ``[Tk, Hkv, Dv]`` values; ``D`` and ``Dv`` any multiple of 8 from 8 to 256.
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
            :func:`thd.layout.validate` yourself once per batch (an invalid layout then gives
            garbage in the output, never a write outside a tensor).
        max_seqlen_kv: largest real key length (same rules).
        causal: bottom-right aligned causal mask: query i sees key j iff
            ``j <= i + Lk_b - Lq_b``.
        softmax_scale: defaults to ``D ** -0.5``.
        window_size: ``(left, right)``: query i, at key position ``i' = i + Lk_b - Lq_b``,
            sees key j iff ``i' - left <= j <= i' + right``; ``-1`` leaves a side unbounded.
            ``causal=True`` is ``right = 0`` (a ``right > 0`` with it is an error).
        softcap: when > 0, scores are ``softcap * tanh(q.k * scale / softcap)``.
        sinks: ``[Hq]`` logits (differentiable): each real query row's softmax denominator
            gets an extra ``exp(sinks[h])`` with no value row. ``lse`` then includes it.
        return_lse: also return the log-sum-exp of the scores.
        deterministic: use the backward without atomics (bitwise reproducible; also chosen by
            ``torch.use_deterministic_algorithms(True)``). Without it the backward may add dQ
            with atomics (``THD_DQ_MODE=1|2``); on the GPU the default is still the split,
            atomic-free backward, which measured faster on the H200.

    Returns:
        ``out [Tq, Hq, Dv]`` in ``q.dtype`` and, with ``return_lse``, ``lse [Hq, Tq]`` fp32.
        Rows that are not real query rows (slot padding, tail, reserved capacity) hold
        exact zeros in ``out`` and ``-inf`` in ``lse``, as does a query that sees no key
        (without sinks); their gradients are exact zeros. Padding rows of q, k, v are never read.

    Examples::

        >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32, device="cuda")
        >>> cup = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")
        >>> q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16)
        >>> out = thd.attention(q, q, q, cu, cu, cu_seqlens_q_padded=cup,
        ...                     cu_seqlens_kv_padded=cup, max_seqlen_q=3, max_seqlen_kv=3,
        ...                     causal=True)
    """
    check_keywords("attention", kw, ATTENTION_ARGS)
    cu_seqlens_q_padded = kw.get("cu_seqlens_q_padded")
    cu_seqlens_kv_padded = kw.get("cu_seqlens_kv_padded")
    max_seqlen_q, max_seqlen_kv = kw.get("max_seqlen_q"), kw.get("max_seqlen_kv")
    sinks = kw.get("sinks")
    # The public arguments in the order of VarlenLayout's first fields.
    layout = VarlenLayout(
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv
    )
    options = score_options("attention", q, kw, causal=False, deterministic=kw.get("deterministic", False))
    check_call("attention", q, k, v, layout, options, sinks)
    if max_seqlen_q is None or max_seqlen_kv is None:
        if not is_capturing():  # a device-to-host read is paid here anyway: check the values with it
            validate_layout(cu_seqlens_q, cu_seqlens_q_padded, num_rows=q.shape[0])
            validate_layout(cu_seqlens_kv, cu_seqlens_kv_padded, num_rows=k.shape[0])
    else:  # no host read allowed: THD_VALIDATE=device asserts the layout on the device instead
        check_layout_async("attention", cu_seqlens_q, cu_seqlens_q_padded, num_rows=q.shape[0])
        check_layout_async("attention", cu_seqlens_kv, cu_seqlens_kv_padded, num_rows=k.shape[0])
    layout = resolve_max_seqlens(layout)
    if torch.compiler.is_compiling():
        out, lse = _attention_fwd_op(q, k, v, sinks, *schema.flatten(layout, options))
    elif _no_gradients():  # the Function would add only its dispatch cost: no graph to record
        out, lse = forward_call(ForwardCall(q, k, v, layout, options, sinks))
    else:
        out, lse = AttentionFunction.apply(q, k, v, sinks, layout, options)
    return (out, lse) if kw.get("return_lse", False) else out
