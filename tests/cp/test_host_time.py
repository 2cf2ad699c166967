"""Host-time shortcuts of the ring (issue 12) keep its behaviour: the per-call environment read,
the exchange records, the reused fork/join events, the membership cache, the forward without
autograd when nothing needs a gradient and the launch plans its per-call layouts find (issue 22)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import spawn

from tests._helpers import shortcut_agrees
from tests.cp._thread_ring import rank0_of_two_alone
from thd._runtime import config
from thd.cp import comm as comm_mod
from thd.cp import partition, ring_attention
from thd.cp import ring as ring_mod
from thd.cp import transport as tp
from thd.errors import ThdDistributedError, ThdValueError
from thd.ops.attention import launch


def test_transport_env_is_read_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tp.ENV, "NCCL")
    assert tp.requested_transport() == "nccl"
    monkeypatch.setenv(tp.ENV, "nccl_high_priority")
    assert tp.requested_transport() == "nccl-high-priority"
    monkeypatch.setenv(tp.ENV, "NCCL")  # parsed before: the same answer from the memo
    assert tp.requested_transport() == "nccl"
    monkeypatch.delenv(tp.ENV)
    assert tp.requested_transport() == "auto"
    for _ in range(2):  # an unknown value is never memoised: it raises every time
        monkeypatch.setenv(tp.ENV, "carrier-pigeon")
        with pytest.raises(ThdValueError, match="carrier-pigeon"):
            tp.requested_transport()


class _FakeEvent:
    made = 0

    def __init__(self) -> None:
        _FakeEvent.made += 1
        self.recorded_on: list[object] = []

    def record(self, stream: object) -> None:
        self.recorded_on.append(stream)


class _FakeStream:
    def __init__(self, handle: int, index: int = 0) -> None:
        self.cuda_stream, self.device_index = handle, index
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def test_wait_reuses_one_event_per_producer_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(comm_mod, "_EVENTS", {})
    _FakeEvent.made = 0
    current, side, other = _FakeStream(1), _FakeStream(2), _FakeStream(3)
    for _ in range(3):
        comm_mod.wait_stream(side, current)  # fork
        comm_mod.wait_stream(current, side)  # join
    comm_mod.wait_stream(side, other)
    assert _FakeEvent.made == 3  # one per producer stream, never one per wait
    fork = comm_mod._EVENTS[(0, 1)]
    assert fork.recorded_on == [current] * 3 and side.waited[:3] == [fork] * 3
    assert current.waited == [comm_mod._EVENTS[(0, 2)]] * 3


def _worker(rank: int, world: int) -> None:
    # Exchange records: the fields of dist.P2POp, peers in group order.
    group = dist.group.WORLD
    comm = tp.ring_comm(group, torch.empty(0))
    t = torch.zeros(3)
    send, recv = comm.send(t, 1, 7), comm.recv(t, -1, 8)
    assert (send.op, send.peer, send.tag) == (dist.isend, (rank + 1) % world, 7) and send.tensor is t
    assert (recv.op, recv.peer, recv.tag) == (dist.irecv, (rank - 1) % world, 8)
    assert recv.group is comm.p2p_group
    op = send.p2p_op()
    assert isinstance(op, dist.P2POp) and (op.op, op.peer, op.tag) == (dist.isend, send.peer, 7)
    # Membership: checked once per group, a non-member is still rejected on every call.
    assert comm_mod.resolve_group("f", None) is group
    assert comm_mod.resolve_group("f", None) is group
    only_zero = dist.new_group([0])
    for _ in range(2):
        if rank == 0:
            assert comm_mod.resolve_group("f", only_zero) is only_zero
        else:
            with pytest.raises(ThdDistributedError, match="not a member"):
                comm_mod.resolve_group("f", only_zero)
    # No gradient needed: the forward without autograd.Function gives the same bits.
    m = 2 * world
    lens, slots = [13, 2 * m, 5], [_up(13, m), 2 * m, _up(5, m)]
    cu = torch.tensor([0, *_cumsum(lens)], dtype=torch.int32)
    cup = torch.tensor([0, *_cumsum(slots)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (partition(torch.randn(sum(slots), 2, 16, generator=gen), cup, world, rank) for _ in range(3))
    for max_seqlen in (None, max(lens)):
        kwargs = dict(causal=True, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, return_lse=True)
        qg = q.clone().requires_grad_()
        out_g, lse_g = ring_attention(qg, k, v, cu, cu, cup, cup, **kwargs)
        assert out_g.grad_fn is not None
        with torch.no_grad():
            out_n, lse_n = ring_attention(qg, k, v, cu, cu, cup, cup, **kwargs)
        out_p, lse_p = ring_attention(q, k, v, cu, cu, cup, cup, **kwargs)  # nothing requires grad
        for out, lse in ((out_n, lse_n), (out_p, lse_p)):
            assert out.grad_fn is None and not out.requires_grad
            assert torch.equal(out, out_g.detach()) and torch.equal(lse, lse_g)
        before = dict(ring_mod.path_counts)
        ring_attention(q, k, v, cu, cu, cup, cup, **kwargs)
        assert ring_mod.path_counts["rank_counts"] == before.get("rank_counts", 0) + 1


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


@pytest.mark.distributed
def test_host_time_shortcuts_gloo() -> None:
    spawn(_worker, 2, timeout_s=120)


@pytest.mark.skipif(not config.interpreting(), reason="the tl kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["plain", "windowed"])
def test_ring_launches_reuse_cached_plans_across_calls(
    monkeypatch: pytest.MonkeyPatch, window: tuple[int, int]
) -> None:
    """The ring makes new layout tensors (and options) on every call: its launches find the plans
    the first call made (none is added), and a call served from the plans of other document
    boundaries gives, bitwise, what it gives with plans of its own (rank 0 of 2, alone)."""
    q, k, v, do = rank0_of_two_alone(monkeypatch)

    def call(boundaries: list[int]) -> list[torch.Tensor]:
        cu = torch.tensor(boundaries, dtype=torch.int32)  # a new tensor each call; slots of 4k rows
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        bounds = {"max_seqlen_q": 12, "max_seqlen_kv": 12, "window_size": window}
        out = ring_attention(*leaves, cu, cu, cu, cu, causal=True, **bounds)
        return [out, *torch.autograd.grad(out, leaves, do)]

    try:
        launch.clear_plans()
        want = call([0, 4, 16])  # plans of its own
        launch.clear_plans()
        first = call([0, 12, 16])
        counts = launch.plan_counts()
        assert counts[0] > 0 and counts[1] > 0
        assert all(torch.equal(a, b) for a, b in zip(first, call([0, 12, 16]), strict=True))
        got = call([0, 4, 16])
        assert launch.plan_counts() == counts
    finally:
        launch.clear_plans()
    assert not torch.equal(first[0], got[0])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not config.interpreting(), reason="the tl kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["plain", "windowed"])
def test_ring_backward_computes_delta_once(monkeypatch: pytest.MonkeyPatch, window: tuple[int, int]) -> None:
    """The ring's backward runs the preprocess (``rowsum(dO * out)``) once over the rank's rows
    instead of once per launch, and its gradients are, bitwise, those of one preprocess per launch
    (rank 0 of 2, alone)."""
    q, k, v, do = rank0_of_two_alone(monkeypatch)
    preprocess = launch.LAUNCHERS["preprocess"]
    counted = {"launches": 0}
    for name in ("run", "run_fixed"):
        original = getattr(preprocess, name)

        def counting(*args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            counted["launches"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(preprocess, name, counting)

    def grads() -> tuple[list[torch.Tensor], int]:
        cu = torch.tensor([0, 12, 16], dtype=torch.int32)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, cu, cu, cu, cu, causal=True, max_seqlen_q=12, max_seqlen_kv=12,
                             window_size=window)  # fmt: skip
        counted["launches"] = 0
        got = list(torch.autograd.grad(out, leaves, do))
        return got, counted["launches"]

    shared, once = grads()
    monkeypatch.setattr(ring_mod, "query_rows_delta", lambda plan, do, saved: None)
    own, per_launch = grads()
    assert once == 1 and per_launch > 1, (once, per_launch)
    for name, a, b in zip(("dq", "dk", "dv"), shared, own, strict=True):
        assert torch.equal(a, b), name


def test_ring_metadata_checks_take_the_common_call_shortcut_only_where_they_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``check_metadata`` skips its shape/dtype/device checks when ``passes_call_checks`` vouches
    for them: every case raises the same error (or none) with the shortcut as without it."""
    from thd.cp import checks
    from thd.errors import ThdError
    from thd.ops.attention.params import VarlenLayout

    i32 = torch.int32
    cu, cup = torch.tensor([0, 3, 8], dtype=i32), torch.tensor([0, 4, 8], dtype=i32)
    base = {"q": torch.zeros(8, 4, 64), "k": torch.zeros(8, 2, 64), "v": torch.zeros(8, 2, 32),
            "cu": cu, "cup": cup, "max": 5, "causal": True}  # fmt: skip
    variants = {
        "q": [torch.zeros(8, 4, 64, dtype=torch.float64), torch.zeros(8, 3, 64), torch.zeros(6, 4, 64),
              torch.zeros(8, 4), torch.zeros(8, 4, 64, dtype=torch.bfloat16),
              torch.zeros(8, 4, 64, device="meta")],
        "k": [torch.zeros(7, 2, 64), torch.zeros(8, 0, 64), torch.zeros(8, 2, 32),
              torch.zeros(8, 2, 64).half()],
        "v": [torch.zeros(8, 2, 4), torch.zeros(8, 1, 32), torch.zeros(7, 2, 32)],
        "cu": [cu.long(), cu[None], torch.zeros(0, dtype=i32), cu.to("meta"), [0, 3, 8]],
        "cup": [None, cu, torch.tensor([0, 8], dtype=i32), cup.float(), (0, 4, 8)],
        "max": [None, 0, -1, 2**31, True, 3.0],
        "causal": [False],
    }  # fmt: skip

    def outcome(case: dict, shortcut: bool) -> object:
        layout = VarlenLayout(case["cu"], case["cu"], case["cup"], case["cup"], case["max"], case["max"])
        with monkeypatch.context() as patch:
            if not shortcut:
                patch.setattr(checks, "passes_call_checks", lambda *args: False)
            try:
                checks.check_metadata(case["q"], case["k"], case["v"], layout, case["causal"])
            except (ThdError, AttributeError, TypeError) as error:
                return (type(error), str(error))
        return None

    cases = [base] + [{**base, name: value} for name, values in variants.items() for value in values]
    cases.append({**base, "k": torch.zeros(6, 2, 64), "v": torch.zeros(6, 2, 32), "causal": False})
    assert shortcut_agrees(cases, outcome) >= 5  # the shortcut's cases are among them
