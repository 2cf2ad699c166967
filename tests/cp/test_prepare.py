"""``thd.cp.prepare``: a ring call's checked options and plan, reused for a repeat call only.

The oracle for a reused result is the same call prepared with the cache empty (fresh checks and a
fresh plan of the current values); a call that differs in anything the checks or the plan read
(a layout tensor object or its version, a shard's shape, stride or dtype, the sinks, a score
argument, a bound) must be prepared anew, an invalid call must raise every time, and a call that
may read device memory (whose checks gather over the group) never touches the cache.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.cp._thread_ring import SelfComm
from thd.cp.plan_cache import clear_plan_cache
from thd.cp.prepare import PreparedCall, RingCall, clear_prepared_calls, prepare_call, prepare_counts
from thd.errors import ThdError
from thd.ops.attention.params import VarlenLayout

COMM = SelfComm(2, 0)


pytestmark = pytest.mark.usefixtures("fresh_ring_caches")


def _shards(rows: int = 8, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(rows, 2, 16, dtype=dtype, generator=gen) for _ in range(3))  # type: ignore[return-value]


def _layout(cu: Tensor, bound: int = 12) -> VarlenLayout:
    return VarlenLayout(cu, cu, cu, cu, bound, bound)


def _offsets() -> Tensor:
    return torch.tensor([0, 12, 16], dtype=torch.int32)


def _prepare(shards, layout, scores=None, pad=None, sync_ok=False) -> PreparedCall:  # type: ignore[no-untyped-def]
    return prepare_call(
        RingCall(COMM, shards, layout, pad, {"causal": True, **(scores or {})}), sync_ok=sync_ok
    )


def _equal(a: PreparedCall, b: PreparedCall) -> bool:
    """Same options and the same plan values (field by field; tensors by value)."""
    if a.options != b.options or type(a.plan) is not type(b.plan):
        return False
    for name in vars(a.plan):
        x, y = getattr(a.plan, name), getattr(b.plan, name)
        same = torch.equal(x, y) if isinstance(x, Tensor) else repr(x) == repr(y)
        if not same:
            return False
    return True


def test_a_repeat_call_gets_the_first_calls_result() -> None:
    shards, cu = _shards(), _offsets()
    first = _prepare(shards, _layout(cu))
    again = _prepare(_shards(), _layout(cu))  # new shard tensors of the same metadata, same offsets
    assert again is first
    assert prepare_counts == {"misses": 1, "hits": 1}
    clear_prepared_calls()
    clear_plan_cache()
    assert _equal(first, _prepare(shards, _layout(cu)))


@pytest.mark.parametrize(
    "change",
    [
        "offsets written",
        "new offsets",
        "rows",
        "dtype",
        "stride",
        "softcap",
        "window",
        "scale",
        "bound",
        "pad",
        "sinks",
    ],
)
def test_anything_the_checks_or_plan_read_prepares_anew(change: str) -> None:
    shards, cu = _shards(), _offsets()
    first = _prepare(shards, _layout(cu))
    layout, scores, pad = _layout(cu), {}, None
    if change == "offsets written":
        cu[1] = 10  # the same tensor, written in place
    elif change == "new offsets":
        layout = _layout(_offsets())
    elif change == "rows":
        shards = _shards(rows=16)
        layout = _layout(torch.tensor([0, 20, 32], dtype=torch.int32), 20)
    elif change == "dtype":
        shards = _shards(dtype=torch.float64)
    elif change == "stride":
        shards = tuple(torch.randn(2, 8, 16).transpose(0, 1) for _ in range(3))  # type: ignore[assignment]
    elif change == "softcap":
        scores = {"softcap": 30.0}
    elif change == "window":
        scores = {"window_size": (4, 0)}
    elif change == "scale":
        scores = {"softmax_scale": 0.5}
    elif change == "bound":
        layout = _layout(cu, 13)
    elif change == "pad":
        pad = True
    else:
        scores = {"sinks": torch.zeros(2)}
    second = _prepare(shards, layout, scores, pad)
    assert second is not first
    assert prepare_counts["misses"] == 2 and prepare_counts["hits"] == 0
    clear_prepared_calls()
    clear_plan_cache()
    assert _equal(second, _prepare(shards, layout, scores, pad))


@pytest.mark.parametrize(
    "scores",
    [{"softcap": -1.0}, {"window_size": (-2, 0)}, {"sinks": torch.zeros(3)}, {"no_such_argument": 1}],
    ids=["softcap", "window", "sinks", "keyword"],
)
def test_an_invalid_call_raises_every_time(scores: dict) -> None:
    shards, cu = _shards(), _offsets()
    for _ in range(3):
        with pytest.raises(ThdError):
            _prepare(shards, _layout(cu), scores)
    assert prepare_counts["hits"] == 0


def test_unhashable_score_arguments_are_checked_and_not_cached() -> None:
    shards, cu = _shards(), _offsets()
    first = _prepare(shards, _layout(cu), {"window_size": [4, 0]})
    second = _prepare(shards, _layout(cu), {"window_size": [4, 0]})
    assert second is not first and _equal(first, second)
    assert prepare_counts == {"uncached": 2}


def test_calls_that_may_read_device_memory_run_every_check() -> None:
    """``sync_ok``: the checks (with their collective, here a one-rank gather) run on every call."""
    import thd.cp.checks as checks

    shards, cu = _shards(), _offsets()
    seen: list[int] = []
    comm = SelfComm(2, 0)
    comm.group = None  # type: ignore[attr-defined]  # the gather below stands in for the group's

    def gather(group, device, values):  # type: ignore[no-untyped-def]
        seen.append(len(values))
        return [list(values), list(values)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checks, "all_gather_ints", gather)
        first, second = (
            prepare_call(RingCall(comm, shards, _layout(cu), None, {"causal": True}), sync_ok=True)
            for _ in range(2)
        )
    assert len(seen) == 2
    assert not prepare_counts
    assert _equal(first, second)


def test_under_capture_the_call_is_prepared_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    import thd.cp.prepare as prepare

    shards, cu = _shards(), _offsets()
    first = _prepare(shards, _layout(cu))
    monkeypatch.setattr(prepare, "is_capturing", lambda: True)
    assert _prepare(shards, _layout(cu)) is not first
    assert prepare_counts == {"misses": 1, "capturing": 1}
