"""``thd.cp.plan_cache``: a ring plan is reused only for the same, unchanged layout tensors.

The oracle is :func:`thd.cp.plan.build_plan` on the same request: a cached plan must hold what a
fresh plan of the current values holds, and a write into an offsets tensor, new tensors with the
same values, another request or CUDA-graph capture must each build anew.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from torch import Tensor

from tests._helpers import capture_graph
from tests.cp._thread_ring import SelfComm, one_rank_ring, rank0_of_two_alone
from thd._runtime import config
from thd.cp import plan_cache, ring_attention
from thd.cp.plan import PlanRequest, RingPlan, build_plan
from thd.cp.plan_cache import CAPACITY, clear_plan_cache, plan_cache_counts, plan_for
from thd.cp.prepare import prepare_counts
from thd.ops.attention.params import AttentionOptions, VarlenLayout

pytestmark = pytest.mark.usefixtures("fresh_ring_caches")


def _request(cu: Tensor, cup: Tensor, rank: int = 0, window: tuple[int, int] = (-1, -1)) -> PlanRequest:
    options = AttentionOptions(0.5, causal=True, window_size=window)
    layout = VarlenLayout(cu, cu, cup, cup, 9, 9)
    return PlanRequest(layout, options, cp_size=2, cp_rank=rank, pad_between_seqs=True)


def _offsets(values: list[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _tensors(plan: RingPlan) -> list[Tensor]:
    """Every tensor a plan holds: its local offsets and each launch's layout tensors."""
    out = [
        plan.cu_seqlens_q_local,
        plan.cu_seqlens_q_padded_local,
        plan.cu_seqlens_kv_local,
        plan.cu_seqlens_kv_padded_local,
    ]
    for step in plan.steps:
        for launch in step:
            out += [t for t in vars(launch.layout).values() if isinstance(t, Tensor)]
    return out


def _same_values(a: RingPlan, b: RingPlan) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["plain", "windowed"])
def test_same_unchanged_tensors_reuse_the_plan(window: tuple[int, int]) -> None:
    cu, cup = _offsets([0, 5, 9]), _offsets([0, 8, 16])
    first = plan_for(_request(cu, cup, window=window))
    assert plan_for(_request(cu, cup, window=window)) is first  # a new request, the same tensors
    assert plan_cache_counts == {"misses": 1, "hits": 1}
    assert _same_values(first, build_plan(_request(cu, cup, window=window)))


def test_a_write_into_the_offsets_builds_a_new_plan() -> None:
    cu, cup = _offsets([0, 5, 9]), _offsets([0, 8, 16])
    before = plan_for(_request(cu, cup))
    cu[1] = 3  # in place: the tensor's version moves
    after = plan_for(_request(cu, cup))
    assert after is not before and plan_cache_counts["misses"] == 2
    assert _same_values(after, build_plan(_request(cu, cup)))
    assert not _same_values(after, before)
    cu.copy_(_offsets([0, 5, 9]))  # the old values again, written: still a new version
    assert plan_for(_request(cu, cup)) is not before


def test_equal_bounds_as_new_int_objects_reuse_the_plan() -> None:
    """``max_seqlen_*`` are matched by value: a bound recomputed each step (a new ``int`` object
    above 256) still finds the plan; another value does not."""
    cu, cup = _offsets([0, 5, 9]), _offsets([0, 8, 16])
    options = AttentionOptions(0.5, causal=True)

    def request(bound: int) -> PlanRequest:
        layout = VarlenLayout(cu, cu, cup, cup, bound, bound)
        return PlanRequest(layout, options, cp_size=2, cp_rank=0, pad_between_seqs=True)

    first = plan_for(request(int("1000")))
    assert plan_for(request(int("1000"))) is first  # equal, not identical
    assert plan_for(request(1001)) is not first
    assert plan_cache_counts == {"misses": 2, "hits": 1}


def test_options_hash_once_and_as_their_fields() -> None:
    """Options hash as the tuple of their fields (equal options, equal hashes; -0.0 and 0.0 are
    equal) and keep it: every cached plan's key holds them."""
    a = AttentionOptions(0.5, causal=True, window_size=(3, 0), softcap=1.0)
    assert hash(a) == hash((0.5, True, (3, 0), 1.0, False)) == hash(AttentionOptions(0.5, True, (3, 0), 1.0))
    assert hash(AttentionOptions(0.0)) == hash(AttentionOptions(-0.0)) and AttentionOptions(
        0.0
    ) == AttentionOptions(-0.0)
    assert hash(a) == hash(a) and a.__dict__["_hash"] == hash(a)
    assert {a: 1}[AttentionOptions(0.5, causal=True, window_size=(3, 0), softcap=1.0)] == 1


def test_equal_values_in_new_tensors_build_a_new_plan() -> None:
    first = plan_for(_request(_offsets([0, 5, 9]), _offsets([0, 8, 16])))
    second = plan_for(_request(_offsets([0, 5, 9]), _offsets([0, 8, 16])))
    assert second is not first and _same_values(second, first)
    assert plan_cache_counts == {"misses": 2}


def test_another_request_on_the_same_tensors_builds_its_own_plan() -> None:
    cu, cup = _offsets([0, 5, 9]), _offsets([0, 8, 16])
    rank0, rank1 = plan_for(_request(cu, cup, rank=0)), plan_for(_request(cu, cup, rank=1))
    assert rank1 is not rank0 and _same_values(rank1, build_plan(_request(cu, cup, rank=1)))
    windowed = plan_for(_request(cu, cup, window=(3, 0)))
    assert windowed is not rank0 and windowed.windowed
    assert plan_for(_request(cu, cup, rank=0)) is rank0


def test_capture_never_uses_or_fills_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    cu, cup = _offsets([0, 5, 9]), _offsets([0, 8, 16])
    eager = plan_for(_request(cu, cup))
    monkeypatch.setattr(plan_cache, "is_capturing", lambda: True)
    captured = [plan_for(_request(cu, cup)) for _ in range(2)]
    assert all(plan is not eager for plan in captured) and captured[0] is not captured[1]
    assert plan_cache_counts == {"misses": 1, "capturing": 2}


def test_inference_tensors_are_planned_every_call() -> None:
    with torch.inference_mode():  # such tensors have no version counter to key on
        cu, cup = _offsets([0, 5, 9]), _offsets([0, 8, 16])
        plans = [plan_for(_request(cu, cup)) for _ in range(2)]
    assert plans[0] is not plans[1] and _same_values(plans[0], plans[1])
    assert plan_cache_counts == {"uncached": 2}


def test_the_cache_keeps_the_last_plans_only() -> None:
    cup = _offsets([0, 8, 16])
    layouts = [_offsets([0, 1 + i % 7, 9]) for i in range(CAPACITY + 1)]
    plans = [plan_for(_request(cu, cup)) for cu in layouts]
    assert plan_for(_request(layouts[-1], cup)) is plans[-1]
    assert plan_for(_request(layouts[0], cup)) is not plans[0]  # the oldest was dropped
    assert plan_cache_counts == {"misses": CAPACITY + 2, "hits": 1}


@pytest.mark.skipif(not config.interpreting(), reason="the tl kernels on CPU need TRITON_INTERPRET=1")
def test_ring_calls_on_the_same_offsets_share_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ring calls on the same offsets tensors (two layers of one step; rank 0 of 2, alone):
    the second reuses the first's prepared call (so its plan: the plan cache is not even asked)
    and gives, bitwise, what a call on new tensors gives."""
    q, k, v, do = rank0_of_two_alone(monkeypatch)

    def call(cu: Tensor) -> list[Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, cu, cu, cu, cu, causal=True, max_seqlen_q=12, max_seqlen_kv=12)
        return [out, *torch.autograd.grad(out, leaves, do)]

    cu = _offsets([0, 12, 16])
    first, second = call(cu), call(cu)
    assert plan_cache_counts == {"misses": 1} and prepare_counts == {"misses": 1, "hits": 1}
    fresh = call(_offsets([0, 12, 16]))
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), first, second, fresh, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name


@pytest.mark.gpu
def test_graph_replay_on_new_offsets_after_cached_eager_calls_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager ring calls on the offsets first (their plan cached), then a CUDA-graph capture: the graph
    holds its own plan kernels, so a replay after new offsets are copied into the captured tensors
    equals an eager call on those offsets (a graph replaying the cached plan would not). One rank of
    2 alone: its exchanges hand it back its own blocks, copies the graph captures."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    comm = SelfComm(2, 0)
    one_rank_ring(monkeypatch, lambda: comm)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(64, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cup = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")  # two slots of 64 rows
    batches = [[0, 40, 100], [0, 64, 71], [0, 8, 72]]
    cu = torch.tensor(batches[0], dtype=torch.int32, device="cuda")

    bounds = {"max_seqlen_q": 64, "max_seqlen_kv": 64}

    def step() -> Tensor:
        with torch.no_grad():
            return ring_attention(q, k, v, cu, cu, cup, cup, causal=True, pad_between_seqs=True, **bounds)

    for _ in range(2):
        step()
    assert prepare_counts["hits"] >= 1
    graph, out = capture_graph(step)
    assert plan_cache_counts["capturing"] == 1 and prepare_counts["capturing"] == 1
    for values in batches[1:]:
        cu.copy_(torch.tensor(values, dtype=torch.int32, device="cuda"))
        graph.replay()
        want = step()  # eager: the write moved cu's version, so a plan of these values
        assert torch.equal(out, want), f"replay on offsets {values} differs from the eager call"


def test_every_layout_field_takes_part_in_the_key() -> None:
    """A request that differs from a cached one in any one field of its layout (another tensor
    object with the same values, a bound, a tensor given or left out) builds anew: a field added
    to VarlenLayout but not to the cache's key fails here."""
    cu, cup, pos = _offsets([0, 5, 9]), _offsets([0, 8, 16]), _offsets([0, 0])
    options = AttentionOptions(0.5, causal=False)
    base = {
        f.name: getattr(VarlenLayout(cu, cu, cup, cup, 9, 9, pos, pos), f.name) for f in fields(VarlenLayout)
    }

    def request(layout: dict) -> PlanRequest:
        return PlanRequest(VarlenLayout(**layout), options, cp_size=2, cp_rank=0, pad_between_seqs=True)

    first = plan_for(request(base))
    assert plan_for(request(dict(base))) is first
    for name, value in base.items():
        other = value.clone() if isinstance(value, Tensor) else value + 1
        changed = {**base, name: other}
        assert plan_for(request(changed)) is not first, name
        clear_plan_cache()
        first = plan_for(request(base))
    for pair in (("cu_seqlens_q_padded", "cu_seqlens_kv_padded"), ("positions_q", "positions_kv")):
        assert plan_for(request({**base, pair[0]: None, pair[1]: None})) is not first, pair
