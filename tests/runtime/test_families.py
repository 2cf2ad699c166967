"""``thd._runtime.families``: which implementation runs an attention call.

A fake ``gluon`` family (the typed-call interface of ``thd.ops.attention.gluon.family``),
injected through the attention registry, records
what it is asked and runs the reference; the tests drive the real selection (environment, device
predicate, loading, ``supports_*``) and check who ran each call, what :func:`kernel_choice`
reports and the errors of a forced family that cannot run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import thd
from thd._runtime.families import FamilyRegistry, OptionalFamily
from thd.errors import ThdValueError
from thd.ops.attention import dispatch, kernel_choice, reference
from thd.ops.attention.params import BackwardCall, ForwardCall


class FakeFamily:
    """A kernel family that accepts calls by a rule, runs the reference and logs each call;
    ``prefers``: what its ``auto_*`` answer (``None``: it has no ``auto_*``)."""

    def __init__(
        self, forward_ok: bool = True, backward_ok: bool = True, prefers: bool | None = None
    ) -> None:
        self.forward_ok, self.backward_ok = forward_ok, backward_ok
        self.calls: list[str] = []
        if prefers is not None:
            self.auto_forward = self.auto_backward = lambda call: prefers

    def supports_forward(self, call: ForwardCall) -> bool:
        return self.forward_ok

    def supports_backward(self, call: BackwardCall) -> bool:
        return self.backward_ok

    def forward(self, call: ForwardCall):  # type: ignore[no-untyped-def]
        assert (
            call.layout.max_seqlen_q is not None and call.layout.max_seqlen_kv is not None
        )  # resolved first
        self.calls.append("forward")
        return reference.forward(call)

    def backward(self, call: BackwardCall):  # type: ignore[no-untyped-def]
        self.calls.append("backward")
        return reference.backward(call)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[FamilyRegistry]:
    """The attention registry with a fake ``tl`` and a fake ``gluon`` chosen on every device, on CPU
    tensors sent to the kernels (``THD_ATTENTION_BACKEND=triton``); restored afterwards."""
    families = dispatch.FAMILIES
    saved = (dict(families._loaded), dict(families._missing), dict(families._last), dict(families.optional))
    families.register("tl", FakeFamily())
    monkeypatch.setitem(
        families.optional, "gluon", OptionalFamily(load=families.optional["gluon"].load, auto=lambda x: True)
    )
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "triton")
    monkeypatch.delenv("THD_KERNELS", raising=False)
    yield families
    families._loaded, families._missing, families._last = saved[0], saved[1], saved[2]
    families.optional.clear()
    families.optional.update(saved[3])


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 2, 16, generator=gen) for _ in range(3))
    return q, k, v, cu


def _run(backward: bool = True) -> torch.Tensor:
    q, k, v, cu = _inputs()
    q.requires_grad_()
    out = thd.attention(q, k, v, cu, cu, causal=True)
    if backward:
        out.sum().backward()
    return out.detach()


def _oracle() -> torch.Tensor:
    q, k, v, cu = _inputs()
    return reference.attention(q, k, v, cu, cu, causal=True)  # type: ignore[return-value]


def test_auto_prefers_gluon_where_it_supports_the_call(registry: FamilyRegistry) -> None:
    gluon, tl = FakeFamily(), registry._loaded["tl"]
    registry.register("gluon", gluon)
    torch.testing.assert_close(_run(), _oracle())
    assert gluon.calls == ["forward", "backward"] and tl.calls == []
    assert kernel_choice("forward").family == kernel_choice("backward").family == "gluon"  # type: ignore[union-attr]
    assert kernel_choice("forward").reason == "auto"  # type: ignore[union-attr]


def test_auto_falls_back_per_phase_and_records_why(registry: FamilyRegistry) -> None:
    gluon, tl = FakeFamily(backward_ok=False), registry._loaded["tl"]
    registry.register("gluon", gluon)
    _run()
    assert gluon.calls == ["forward"] and tl.calls == ["backward"]
    choice = kernel_choice("backward")
    assert choice is not None and (choice.family, choice.reason) == ("tl", "gluon does not support the call")


@pytest.mark.parametrize("prefers", [True, False])
def test_auto_takes_gluon_only_where_it_prefers_the_call(registry: FamilyRegistry, prefers: bool) -> None:
    gluon, tl = FakeFamily(prefers=prefers), registry._loaded["tl"]
    registry.register("gluon", gluon)
    torch.testing.assert_close(_run(), _oracle())
    ran, idle = (gluon, tl) if prefers else (tl, gluon)
    assert ran.calls == ["forward", "backward"] and idle.calls == []
    choice = kernel_choice("backward")
    assert choice is not None
    assert (choice.family, choice.reason) == (
        ("gluon", "auto") if prefers else ("tl", "gluon measured slower for the call")
    )


def test_auto_skips_gluon_off_its_devices(registry: FamilyRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    gluon, tl = FakeFamily(), registry._loaded["tl"]
    registry.register("gluon", gluon)
    monkeypatch.setattr(registry.optional["gluon"], "auto", lambda x: False)  # e.g. not an sm_90 GPU
    _run()
    assert gluon.calls == [] and tl.calls == ["forward", "backward"]
    assert kernel_choice("forward").reason == "default"  # type: ignore[union-attr]


def test_missing_gluon_module_is_unavailable_not_an_error(registry: FamilyRegistry) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'thd.ops.attention.gluon'")

    registry.forget("gluon")
    registry.optional["gluon"] = OptionalFamily(load=missing, auto=lambda x: True)
    torch.testing.assert_close(_run(), _oracle())
    assert registry._loaded["tl"].calls == ["forward", "backward"]
    assert kernel_choice("forward").reason == "gluon unavailable"  # type: ignore[union-attr]
    assert "No module named" in registry.why_missing("gluon")


def test_forced_family_runs_or_raises(registry: FamilyRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    gluon, tl = FakeFamily(forward_ok=False), registry._loaded["tl"]
    registry.register("gluon", gluon)
    monkeypatch.setenv("THD_KERNELS", "tl")
    _run()
    assert tl.calls == ["forward", "backward"] and gluon.calls == []
    assert kernel_choice("forward").reason == "THD_KERNELS"  # type: ignore[union-attr]
    monkeypatch.setenv("THD_KERNELS", "gluon")
    with pytest.raises(ThdValueError, match=r"attention forward: THD_KERNELS=gluon: .*does not support"):
        _run(backward=False)
    registry.forget("gluon")
    registry.optional["gluon"] = OptionalFamily(
        load=lambda: __import__("thd.ops.attention.no_such_family"), auto=lambda x: True
    )
    with pytest.raises(
        ThdValueError, match=r"THD_KERNELS=gluon: the gluon family is not available \(ModuleNotFoundError"
    ):
        _run(backward=False)
    monkeypatch.setenv("THD_KERNELS", "cuda-graphs")
    expected = r"THD_KERNELS='cuda-graphs': expected one of auto, tl, gluon, prefer-gluon"
    with pytest.raises(ThdValueError, match=expected):
        _run(backward=False)


def test_auto_asks_the_speed_rule_before_the_support_check(registry: FamilyRegistry) -> None:
    """A call the rule declines never reaches ``supports_*`` (tensor metadata reads: host time); a
    call it prefers still needs the family's support."""
    asked: list[str] = []

    class Counting(FakeFamily):
        def supports_forward(self, call: ForwardCall) -> bool:
            asked.append("forward")
            return super().supports_forward(call)

        def supports_backward(self, call: BackwardCall) -> bool:
            asked.append("backward")
            return super().supports_backward(call)

    registry.register("gluon", Counting(prefers=False))
    _run()
    assert asked == []
    registry.register("gluon", Counting(backward_ok=False, prefers=True))
    _run()
    assert asked == ["forward", "backward"]
    choice = kernel_choice("backward")
    assert choice is not None and (choice.family, choice.reason) == ("tl", "gluon does not support the call")


@pytest.mark.parametrize("prefers", [False, None])
def test_prefer_gluon_runs_gluon_wherever_it_supports_the_phase(
    registry: FamilyRegistry, monkeypatch: pytest.MonkeyPatch, prefers: bool | None
) -> None:
    gluon, tl = FakeFamily(backward_ok=False, prefers=prefers), registry._loaded["tl"]
    registry.register("gluon", gluon)
    monkeypatch.setattr(registry.optional["gluon"], "auto", lambda x: False)  # no device or speed rule
    monkeypatch.setenv("THD_KERNELS", "prefer-gluon")
    torch.testing.assert_close(_run(), _oracle())
    assert gluon.calls == ["forward"] and tl.calls == ["backward"]
    forward, backward = kernel_choice("forward"), kernel_choice("backward")
    assert forward is not None and (forward.family, forward.reason) == ("gluon", "THD_KERNELS=prefer-gluon")
    assert backward is not None
    assert (backward.family, backward.reason) == ("tl", "gluon does not support the call")


def test_prefer_an_unknown_family_raises(registry: FamilyRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THD_KERNELS", "prefer-tl")  # tl is the default, not an optional family
    with pytest.raises(ThdValueError, match=r"THD_KERNELS='prefer-tl': expected one of .*prefer-gluon"):
        _run(backward=False)


def test_reference_backend_bypasses_the_families(
    registry: FamilyRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    gluon = FakeFamily()
    registry.register("gluon", gluon)
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    monkeypatch.setenv("THD_KERNELS", "gluon")  # the reference wins: no kernel family runs at all
    torch.testing.assert_close(_run(), _oracle())
    assert gluon.calls == [] and registry._loaded["tl"].calls == []
    choice = kernel_choice("forward")
    assert choice is not None and (choice.family, choice.reason) == (
        "reference",
        "THD_ATTENTION_BACKEND=reference",
    )
