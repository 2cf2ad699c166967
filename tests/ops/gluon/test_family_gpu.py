"""``thd.attention`` end to end on the Gluon family (H200): the public call, its custom ops and
``torch.compile(fullgraph=True)`` with ``THD_KERNELS=gluon`` against the same calls on ``tl``, and
which family ``THD_KERNELS=auto`` picks per phase (the measured preference of
``thd.ops.attention.gluon.family``)."""

from __future__ import annotations

import pytest
import torch

import thd
from tests._helpers import Layout, assert_close, assert_rows_equal, make_layout, make_qkv
from thd.ops.attention import kernel_choice
from thd.ops.attention.gluon import family as gluon_family

pytestmark = pytest.mark.gpu

LAYOUT = make_layout("slots", [300, 1, 128, 77, 517], pad_q=[84, 127, 0, 51, 123], capacity_q=5)
LONG = make_layout("long", [1500, 40, 700], pad_q=[12, 0, 3], capacity_q=7)  # max_seqlen above 1024
SHORT = make_layout("short", [300, 1, 128, 77, 500], pad_q=[84, 127, 0, 51, 12], capacity_q=5)  # at most 512
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _sm90() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _step(
    family: str, monkeypatch: pytest.MonkeyPatch, dim: int, dtype: torch.dtype, compiled: bool, layout=LAYOUT
):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("THD_KERNELS", family)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = make_qkv(layout, 8, 2, dim, dim, dtype, "cuda", generator=gen)
    for t in (q, k, v):
        t.requires_grad_()
    kwargs = layout.kwargs("cuda")

    def call(q, k, v):  # type: ignore[no-untyped-def]
        return thd.attention(q, k, v, causal=True, **kwargs)

    fn = torch.compile(call, fullgraph=True) if compiled else call
    out = fn(q, k, v)
    out.backward(do)
    choices = (kernel_choice("forward"), kernel_choice("backward"))
    return out.detach(), q.grad, k.grad, v.grad, choices


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gluon_family_through_thd_attention(
    monkeypatch: pytest.MonkeyPatch, dim: int, compiled: bool
) -> None:
    dtype = torch.bfloat16
    *gluon, gluon_choices = _step("gluon", monkeypatch, dim, dtype, compiled)
    *tl, tl_choices = _step("tl", monkeypatch, dim, dtype, compiled)
    assert [c.family for c in gluon_choices] == ["gluon", "gluon"]
    assert [c.family for c in tl_choices] == ["tl", "tl"]
    rows = {"out": "q", "dq": "q", "dk": "kv", "dv": "kv"}
    for (name, side), g, t in zip(rows.items(), gluon, tl, strict=True):
        real = LAYOUT.real_rows(side, "cuda")
        assert_rows_equal(g, ~real, 0.0, f"gluon {name} padding")
        assert_close(g[real], t[real], f"gluon vs tl {name}", atol=TOL[dtype], rtol=TOL[dtype])


def _assert_matches_tl(monkeypatch: pytest.MonkeyPatch, dim: int, layout: Layout, auto: list) -> None:
    """``auto``'s out and gradients equal tl's on real rows (within bf16 tolerance), zeros elsewhere."""
    *tl, _ = _step("tl", monkeypatch, dim, torch.bfloat16, False, layout)
    sides = {"out": "q", "dq": "q", "dk": "kv", "dv": "kv"}
    for (name, side), a, t in zip(sides.items(), auto, tl, strict=True):
        real = layout.real_rows(side, "cuda")
        assert_rows_equal(a, ~real, 0.0, f"auto {name} padding ({layout.name})")
        tol = TOL[torch.bfloat16]
        assert_close(a[real], t[real], f"auto vs tl {name} ({layout.name})", atol=tol, rtol=tol)


@pytest.mark.parametrize("dim", [64, 128])
def test_auto_picks_the_measured_faster_family(monkeypatch: pytest.MonkeyPatch, dim: int) -> None:
    *_, (forward, backward) = _step("auto", monkeypatch, dim, torch.bfloat16, False, SHORT)
    assert forward.family == "tl" and forward.reason == "gluon measured slower for the call"
    assert backward.family == "tl"  # documents of at most 512 tokens
    # LAYOUT's longest query is 517 tokens: the Gluon forward at head dim 128 (above 512), then
    # tl's backward on the Gluon forward's out and lse
    *auto, (forward, backward) = _step("auto", monkeypatch, dim, torch.bfloat16, False)
    assert forward.family == ("gluon" if dim == 128 else "tl")
    assert backward.family == "tl"
    _assert_matches_tl(monkeypatch, dim, LAYOUT, auto)
    # documents above 1024 tokens (a stated max_seqlen_q): the Gluon forward at head dim 128, the
    # Gluon backward at 64 and 128
    *auto, (forward, backward) = _step("auto", monkeypatch, dim, torch.bfloat16, False, LONG)
    assert forward.family == ("gluon" if dim == 128 else "tl")
    assert backward.family == ("gluon" if dim in gluon_family.AUTO_BACKWARD_HEAD_DIMS else "tl")
    _assert_matches_tl(monkeypatch, dim, LONG, auto)
