"""FlashAttention 2 drop-ins (``thd.flash_attn_varlen_func`` / ``thd.flash_attn_func``).

Oracles: :func:`thd.attention` with the equivalent thd arguments (same backend, so the values
must be identical), and for the dense entry point and padded head dims SDPA's math backend per
sequence with an explicit bottom-right mask in float64. Every test runs on the torch
reference and, under ``TRITON_INTERPRET=1``, on the Triton kernels through the interpreter.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import thd
import thd._runtime.config
from tests._helpers import assert_close
from thd import flash_attn_func, flash_attn_varlen_func
from thd.errors import ThdTypeError, ThdValueError

LENS_Q = [3, 5, 4]  # varlen batch: q rows 0..11
LENS_K = [4, 5, 6]  # keys rows 0..14 (cross-attention: bottom-right alignment matters)


def _cu(lens: list[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _leaves(*shapes: tuple[int, ...]) -> list[Tensor]:
    return [torch.randn(*s, dtype=torch.float32, requires_grad=True) for s in shapes]


def _grads(out: Tensor, inputs: list[Tensor], seed: int = 1) -> list[Tensor]:
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad(out, inputs, do))


# (FlashAttention keyword arguments, the equivalent thd.attention keyword arguments)
VARIANTS = [
    pytest.param({}, {}, id="plain"),
    pytest.param({"causal": True}, {"causal": True}, id="causal"),
    pytest.param({"window_size": (2, 1)}, {"window_size": (2, 1)}, id="window"),
    # FlashAttention 2 sets the right side to 0 under causal; thd.attention refuses right > 0.
    pytest.param(
        {"causal": True, "window_size": (2, 3)}, {"causal": True, "window_size": (2, 0)}, id="causal-window"
    ),
    pytest.param(
        {"softcap": 2.0, "softmax_scale": 0.7}, {"softcap": 2.0, "softmax_scale": 0.7}, id="softcap"
    ),
    pytest.param({"deterministic": True}, {"deterministic": True}, id="deterministic"),
]


def _with_backends(cases: list[Any], on_triton: set[str]) -> list[Any]:
    """Every case on the reference, the ``on_triton`` ones through the interpreter too (the wrapper
    does not depend on the backend, and the interpreter is slow)."""
    return [
        pytest.param(backend, *case.values, id=f"{backend}-{case.id}")
        for backend in ("reference", "triton")
        for case in cases
        if backend == "reference" or case.id in on_triton
    ]


@pytest.mark.parametrize(
    ("backend", "fa_kwargs", "thd_kwargs"),
    _with_backends(VARIANTS, {"causal-window", "softcap"}),
    indirect=["backend"],
)
def test_varlen_equals_thd_attention(
    backend: str, fa_kwargs: dict[str, Any], thd_kwargs: dict[str, Any]
) -> None:
    """GQA (4 query heads on 2 kv heads), cross lengths: out, lse and every gradient identical."""
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    q, k, v = _leaves((12, 4, 16), (15, 2, 16), (15, 2, 16))
    out, lse, probs = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), return_attn_probs=True, **fa_kwargs
    )
    want, want_lse = thd.attention(
        q, k, v, cu_q, cu_k, max_seqlen_q=5, max_seqlen_kv=6, return_lse=True, **thd_kwargs
    )
    assert probs is None
    assert lse.dtype == torch.float32 and lse.shape == (4, 12)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for name, got, ref in zip("qkv", _grads(out, [q, k, v]), _grads(want, [q, k, v]), strict=True):
        assert torch.equal(got, ref), f"d{name}"


def test_varlen_returns_out_alone_by_default(backend: str) -> None:
    cu = _cu(LENS_Q)
    q = torch.randn(12, 2, 8)
    out = flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
    assert isinstance(out, Tensor) and out.shape == (12, 2, 8)


def sdpa_dense(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: tuple[int, int], scale: float
) -> Tensor:
    """[B, Sq, H, Dv] by SDPA's math backend in float64 with FlashAttention's bottom-right mask."""
    sq, sk = q.shape[1], k.shape[1]
    i = torch.arange(sq)[:, None] + sk - sq  # key position of each query
    j = torch.arange(sk)[None, :]
    right = 0 if causal else window[1]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if window[0] >= 0:
        seen &= j >= i - window[0]
    if right >= 0:
        seen &= j <= i + right
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=seen, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


DENSE = [
    pytest.param(False, (-1, -1), 16, id="plain"),
    pytest.param(True, (-1, -1), 16, id="causal"),
    pytest.param(True, (3, -1), 16, id="causal-window"),
    pytest.param(False, (2, 2), 16, id="window"),
    pytest.param(True, (-1, -1), 20, id="causal-headdim20"),
]


@pytest.mark.parametrize(
    ("backend", "causal", "window", "dim"),
    _with_backends(DENSE, {"window", "causal-headdim20"}),
    indirect=["backend"],
)
def test_dense_matches_sdpa(backend: str, causal: bool, window: tuple[int, int], dim: int) -> None:
    """``flash_attn_func`` on [B, S, H, D] (Sq = 5 < Sk = 7, GQA), head dim 20 zero-padded to 24 with
    the default scale of 20: outputs and gradients against SDPA."""
    q, k, v = _leaves((2, 5, 4, dim), (2, 7, 2, dim), (2, 7, 2, dim))
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert probs is None and out.shape == (2, 5, 4, dim)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 5) and lse.is_contiguous()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = sdpa_dense(*leaves, causal=causal, window=window, scale=dim**-0.5)
    assert_close(out, want, "out", atol=2e-4, rtol=2e-4)
    for name, got, ref in zip("qkv", _grads(out, [q, k, v]), _grads(want, leaves), strict=True):
        assert_close(got, ref, f"d{name}", atol=5e-4, rtol=5e-4)
    # lse: the dense batch is the varlen batch with offsets b * S, viewed [B, H, S].
    cu_q = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32)
    _, flat_lse, _ = flash_attn_varlen_func(
        *(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), cu_q, cu_k, 5, 7,
        causal=causal, window_size=window, return_attn_probs=True,
    )  # fmt: skip
    assert torch.equal(lse, flat_lse.view(4, 2, 5).transpose(0, 1))


def test_dense_reads_nothing_on_the_host(no_host_reads: None) -> None:
    """Offsets are built on q's device: meta tensors (no values at all) go through."""
    q = torch.empty(3, 6, 4, 32, device="meta")
    kv = torch.empty(3, 9, 2, 32, device="meta")
    out, lse, _ = flash_attn_func(q, kv, kv, causal=True, return_attn_probs=True)
    assert out.is_meta and out.shape == (3, 6, 4, 32) and lse.shape == (3, 4, 6)


def test_signatures_are_flash_attention_2s() -> None:
    """Parameter names, order and defaults of FlashAttention 2's ``flash_attn_interface``."""
    common = {
        "dropout_p": 0.0,
        "softmax_scale": None,
        "causal": False,
        "window_size": (-1, -1),
        "softcap": 0.0,
        "alibi_slopes": None,
        "deterministic": False,
        "return_attn_probs": False,
    }
    varlen = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    for fn, positional, extra in (
        (flash_attn_varlen_func, varlen, {"block_table": None}),
        (flash_attn_func, ["q", "k", "v"], {}),
    ):
        params = inspect.signature(fn).parameters
        assert list(params) == [*positional, *common, *extra]
        assert all(params[p].default is inspect.Parameter.empty for p in positional)
        assert {p: params[p].default for p in [*common, *extra]} == {**common, **extra}


def test_migration_import() -> None:
    import thd.flash_compat

    assert thd.flash_attn_varlen_func is thd.flash_compat.flash_attn_varlen_func
    assert "flash_attn_varlen_func" in thd.__all__ and "flash_attn_func" in thd.__all__


def _varlen_args(**change: Any) -> dict[str, Any]:
    cu = _cu(LENS_Q)
    q = torch.randn(12, 2, 16)
    args = {
        "q": q,
        "k": q,
        "v": q,
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": 5,
        "max_seqlen_k": 5,
    }
    return {**args, **change}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        pytest.param(
            {"dropout_p": 0.1}, ThdValueError, r"flash_attn_varlen_func: dropout_p: .*got 0\.1", id="dropout"
        ),
        pytest.param({"dropout_p": float("nan")}, ThdValueError, r"dropout_p: .*got nan", id="dropout-nan"),
        pytest.param(
            {"dropout_p": "0"}, ThdTypeError, r"dropout_p: expected a float, got str", id="dropout-str"
        ),
        pytest.param(
            {"alibi_slopes": torch.ones(2)}, ThdValueError, r"alibi_slopes: ALiBi .*shape \[2\]", id="alibi"
        ),
        pytest.param(
            {"block_table": torch.zeros(3, 1, dtype=torch.int32)},
            ThdValueError,
            r"block_table: paged",
            id="paged",
        ),
        pytest.param(
            {"cu_seqlens_k": _cu(LENS_Q).long()},
            ThdTypeError,
            r"flash_attn_varlen_func: attention: cu_seqlens_kv dtype: expected torch\.int32",
            id="cu-int64",
        ),
        pytest.param(
            {"softcap": -1.0}, ThdValueError, r"flash_attn_varlen_func: attention: softcap", id="softcap"
        ),
    ],
)
def test_varlen_errors_name_the_argument(change: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(**_varlen_args(**change))


def test_varlen_without_bounds_derives_them_and_validates() -> None:
    """``max_seqlen_* = None`` (FlashAttention needs ints) takes thd's host read, which validates."""
    args = _varlen_args()
    out = flash_attn_varlen_func(**{**args, "max_seqlen_q": None, "max_seqlen_k": None})
    assert torch.equal(out, flash_attn_varlen_func(**args))
    bad = torch.tensor([0, 8, 4, 12], dtype=torch.int32)
    with pytest.raises(ThdValueError, match=r"cu_seqlens\[2\] \(=4\) < cu_seqlens\[1\]"):
        flash_attn_varlen_func(**{**args, "cu_seqlens_q": bad, "max_seqlen_q": None})


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        pytest.param(
            (torch.randn(4, 2, 8),) * 3,
            {},
            ThdValueError,
            r"flash_attn_func: q shape: expected \[batch",
            id="3d",
        ),
        pytest.param(
            (torch.randn(2, 4, 2, 8), torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)),
            {},
            ThdValueError,
            r"flash_attn_func: batch: .*q 2, k 3",
            id="batch",
        ),
        pytest.param(
            (torch.randn(2, 4, 2, 8),) * 3,
            {"dropout_p": 0.5},
            ThdValueError,
            r"flash_attn_func: dropout_p",
            id="dropout",
        ),
        pytest.param(
            (torch.randn(2, 4, 2, 8),) * 3,
            {"alibi_slopes": torch.ones(2, 2)},
            ThdValueError,
            r"flash_attn_func: alibi_slopes",
            id="alibi",
        ),
        pytest.param(
            (torch.randn(2, 4, 2, 260),) * 3, {}, ThdValueError, r"head_dim: .*got 260", id="headdim-260"
        ),
        pytest.param(
            (torch.randn(2, 4, 3, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8)),
            {},
            ThdValueError,
            r"flash_attn_func: attention: heads",
            id="heads",
        ),
    ],
)
def test_dense_errors_name_the_argument(
    args: tuple[Tensor, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        flash_attn_func(*args, **kwargs)


def test_dense_compiles_without_graph_breaks() -> None:
    """``torch.compile(fullgraph=True)`` (aot_eager on CPU) through the dense view, the device-built
    offsets and the head-dim padding: the eager values, forward and backward."""
    q, k, v = _leaves((2, 5, 4, 20), (2, 7, 2, 20), (2, 7, 2, 20))

    def fn(q_: Tensor, k_: Tensor, v_: Tensor) -> tuple[Tensor, Tensor]:
        out, lse, _ = flash_attn_func(q_, k_, v_, causal=True, window_size=(3, 2), return_attn_probs=True)
        return out, lse

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    (out, lse), (want, want_lse) = compiled(q, k, v), fn(q, k, v)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for name, got, ref in zip("qkv", _grads(out, [q, k, v]), _grads(want, [q, k, v]), strict=True):
        assert torch.equal(got, ref), f"d{name}"
