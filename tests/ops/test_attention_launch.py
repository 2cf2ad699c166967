"""``thd.ops.attention.launch``: each kernel's argument spec is its signature, and the host's argument
tuples follow the spec (every value lands on the parameter of its name)."""

from __future__ import annotations

import inspect

import pytest
import torch

from thd.ops.attention import kernels, launch
from thd.ops.attention.params import AttentionOptions, ForwardCall, VarlenLayout

SPECS = {
    "fwd": (kernels._attention_fwd_kernel, launch.FWD_ARGS),
    "preprocess": (kernels._attention_bwd_preprocess_kernel, launch.PREPROCESS_ARGS),
    "dkdv": (kernels._attention_bwd_dkdv_kernel, launch.DKDV_ARGS),
    "dq": (kernels._attention_bwd_dq_kernel, launch.DQ_ARGS),
}


def _plain_params(fn) -> list[str]:  # type: ignore[no-untyped-def]
    """The kernel's ``arg_names`` that are not ``tl.constexpr``, in order (compiled or interpreted)."""
    annotations = {name: str(p.annotation) for name, p in inspect.signature(fn.fn).parameters.items()}
    return [name for name in fn.arg_names if "constexpr" not in annotations[name]]


@pytest.mark.parametrize("name", list(SPECS))
def test_spec_is_the_kernels_signature(name: str) -> None:
    fn, spec = SPECS[name]
    assert list(spec) == _plain_params(fn)
    assert launch.KERNELS[name] is fn or launch.KERNELS[name].fn is fn  # autotuned: wraps it


def _case() -> dict:  # type: ignore[type-arg]
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    cup = torch.tensor([0, 8, 16], dtype=torch.int32)
    pos = torch.tensor([3, 0], dtype=torch.int32)
    layout = VarlenLayout(cu, cu + 0, cup, cup + 0, 5, 6, pos, pos + 1)
    q = torch.randn(16, 4, 3, 8)[:, :, 0]  # a strided view: every stride differs from the next
    k, v = torch.randn(17, 2, 8)[:16], torch.randn(16, 2, 24)
    out, lse = torch.randn(16, 4, 24), torch.randn(4, 20)[:, :16]
    options = AttentionOptions(softmax_scale=0.3, causal=False, window_size=(7, 2), softcap=5.0)
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "layout": layout, "options": options}


def _common(bound: dict, c: dict) -> None:  # type: ignore[type-arg]
    layout = c["layout"]
    assert bound["cu_q_ptr"] is layout.cu_seqlens_q and bound["cu_k_ptr"] is layout.cu_seqlens_kv
    assert (
        bound["cup_q_ptr"] is layout.cu_seqlens_q_padded and bound["cup_k_ptr"] is layout.cu_seqlens_kv_padded
    )
    assert bound["pos_q_ptr"] is layout.positions_q and bound["pos_k_ptr"] is layout.positions_kv
    assert (bound["rows_q"], bound["rows_k"]) == (16, 16)
    assert (bound["sm_scale"], bound["softcap"], bound["window_left"], bound["window_right"]) == (
        0.3,
        5.0,
        7,
        2,
    )
    for label in ("q", "k", "v"):
        assert (bound[f"stride_{label}t"], bound[f"stride_{label}h"]) == c[label].stride()[:2]
    assert bound["stride_lse_h"] == 16


def test_forward_args_follow_the_spec() -> None:
    c = _case()
    sinks = torch.zeros(4)
    call = ForwardCall(c["q"], c["k"], c["v"], c["layout"], c["options"], sinks)
    args = launch.forward_args(call, c["out"], c["lse"].contiguous())
    assert len(args) == len(launch.FWD_ARGS)
    bound = dict(zip(launch.FWD_ARGS, args, strict=True))
    assert [bound[n] for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "sinks_ptr")] == [
        c["q"],
        c["k"],
        c["v"],
        c["out"],
        sinks,
    ]
    assert (bound["stride_ot"], bound["stride_oh"]) == c["out"].stride()[:2]
    assert bound["seq_bucket"] == 16  # the next power of 2 of max(max_seqlen_q, 16)
    _common(bound, c)


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_backward_args_follow_the_spec(kernel: str) -> None:
    c = _case()
    do, delta = torch.randn(16, 4, 2, 24)[:, :, 1], torch.randn(4, 16)
    lse = c["lse"].contiguous()
    dq, dk, dv = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 2, 24)[:, :, 0]
    grads = (dk, dv, dq) if kernel == "dkdv" else (dq,)
    inputs = (c["q"], c["k"], c["v"], do, lse, delta)
    spec = launch.DKDV_ARGS if kernel == "dkdv" else launch.DQ_ARGS
    args = launch.backward_args(inputs, grads, c["layout"], c["options"])
    shared = launch.backward_shared_args(inputs, c["layout"], c["options"])
    assert launch.backward_args(inputs, grads, c["layout"], c["options"], shared) == args
    bound = dict(zip(spec, args, strict=True))
    assert [bound[n] for n in ("do_ptr", "lse_ptr", "delta_ptr")] == [do, lse, delta]
    assert (bound["stride_dot"], bound["stride_doh"]) == do.stride()[:2]
    named = {"dq": dq, "dk": dk, "dv": dv} if kernel == "dkdv" else {"dq": dq}
    for label, t in named.items():
        assert (bound[f"stride_{label}t"], bound[f"stride_{label}h"]) == t.stride()[:2]
    assert bound["dq_acc_ptr" if kernel == "dkdv" else "dq_ptr"] is dq
    assert bound["seq_bucket"] == 16  # from max(max_seqlen_q, max_seqlen_kv) = 6
    _common(bound, {**c, "lse": lse})


def test_preprocess_args_follow_the_spec() -> None:
    c = _case()
    do, delta, rows = torch.randn(16, 4, 2, 24)[:, :, 1], torch.randn(4, 16), torch.randn(4, 16)
    sinks = torch.zeros(4)
    args = launch.preprocess_args(c["out"], do, delta, c["lse"], sinks, rows, c["layout"])
    bound = dict(zip(launch.PREPROCESS_ARGS, args, strict=True))
    assert [bound[n] for n in ("out_ptr", "do_ptr", "delta_ptr", "sinks_ptr", "dsink_rows_ptr")] == [
        c["out"],
        do,
        delta,
        sinks,
        rows,
    ]
    assert (
        bound["cu_q_ptr"] is c["layout"].cu_seqlens_q
        and bound["cup_q_ptr"] is c["layout"].cu_seqlens_q_padded
    )
    assert (bound["stride_dot"], bound["stride_doh"], bound["stride_lse_h"]) == (*do.stride()[:2], 16)
