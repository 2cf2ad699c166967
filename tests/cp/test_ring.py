"""thd.cp.ring_attention: spawned gloo ranks (CPU) and nccl ranks (GPU) against the global oracle.

Every rank builds the same global batch from a fixed seed, runs the ring on its
:func:`thd.cp.partition` shard (forward and backward) and compares with
:func:`thd.reference.attention` on the unpartitioned batch, partitioned the same way. Many
layouts run inside one spawn because starting processes dominates the cost. The single-process
simulation (:mod:`thd.cp.reference`) checks the schedule on more layouts without spawning.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from _dist import cuda_devices, spawn
from torch import Tensor

import thd.reference
from tests._helpers import assert_close, assert_rows_equal, tolerance
from thd.cp import partition, ring_attention
from thd.cp import ring as ring_mod
from thd.cp.reference import simulate_ring_attention
from thd.errors import ThdDistributedError, ThdValueError

# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Case:
    """A global layout: real lengths, slot lengths and reserved rows after the last slot."""

    name: str
    lens: tuple[int, ...]
    slots: tuple[int, ...]
    capacity: int = 0

    @property
    def rows(self) -> int:
        return sum(self.slots) + self.capacity

    @property
    def padded(self) -> bool:
        return self.lens != self.slots or self.capacity > 0

    def cu(self, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        cu, cup = [0], [0]
        for n, s in zip(self.lens, self.slots, strict=True):
            cu.append(cu[-1] + n)
            cup.append(cup[-1] + s)
        i32 = {"dtype": torch.int32, "device": device}
        return torch.tensor(cu, **i32), torch.tensor(cup, **i32)

    def padding_rows(self, device: torch.device | str = "cpu") -> Tensor:
        """Bool ``[T]``: True on slot padding and reserved rows."""
        pad = torch.ones(self.rows, dtype=torch.bool)
        start = 0
        for n, s in zip(self.lens, self.slots, strict=True):
            pad[start : start + n] = False
            start += s
        return pad.to(device)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def cases(cp: int, scale: int = 1) -> list[Case]:
    """The issue's layout matrix for a group of ``cp`` ranks (``scale`` multiplies the lengths)."""
    m = 2 * cp

    def padded(name: str, lens: list[int], capacity: int = 0) -> Case:
        return Case(name, tuple(lens), tuple(_round_up(n, m) for n in lens), capacity)

    s = scale
    return [
        Case("nopad", (m * s, 3 * m * s, 2 * m * s), (m * s, 3 * m * s, 2 * m * s)),
        padded("tail-not-divisible", [6 * m * s - 2]),  # the "698 tokens at cp=4" shape
        Case("divisible-in-longer-slot", (2 * m * s, m * s), (2 * m * s, 2 * m * s)),  # [8,4] in [8,8]
        padded("middle", [7 * s, 9 * s, 1, 0, 13 * s]),
        Case("zero-and-one-token", (1, 0, 0, 3, 1), (m, 0, m, _round_up(3, m), m)),  # also shorter than 2*cp
        padded("reserved-capacity", [5 * s, m * s], capacity=m),
        Case("capacity-only", (m * s, 2 * m * s), (m * s, 2 * m * s), capacity=m),  # fast path + tail
    ]


_HEADS = ((4, 2, 16, 8), (2, 2, 16, 16))  # (Hq, Hkv, D, Dv): GQA with Dv != D, MHA


def _inputs(case: Case, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = ((hq, d), (hkv, d), (hkv, dv), (hq, dv))
    q, k, v, do = (torch.randn(case.rows, h, x, generator=g).to(device, dtype) for h, x in shapes)
    return q, k, v, do


def _partition_lse(lse: Tensor, cup: Tensor, cp: int, rank: int) -> Tensor:
    return partition(lse.t().contiguous(), cup, cp, rank).t()


def _oracle(case: Case, q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool):
    cu, cup = case.cu(q.device)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = thd.reference.attention(
        qq, kk, vv, cu, cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup, causal=causal, return_lse=True
    )
    if not out.requires_grad:  # no real rows at all: the oracle never touched q, k, v
        return out, lse, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    out.backward(do)
    return out.detach(), lse, qq.grad, kk.grad, vv.grad


def _run_ring(case: Case, shards: list[Tensor], causal: bool, group, *, max_seqlen: bool, pad=None):
    cu, cup = case.cu(shards[0].device)
    q, k, v, do = shards
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    longest = max(case.lens, default=0) if max_seqlen else None
    out, lse = ring_attention(
        q, k, v, cu, cu, cup, cup, group=group, causal=causal, pad_between_seqs=pad,
        max_seqlen_q=longest, max_seqlen_kv=longest, return_lse=True,
    )  # fmt: skip
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _check_case(
    case: Case, cp: int, rank: int, group, causal: bool, heads, dtype, device: str, seed: int
) -> None:
    hq, hkv, d, dv = heads
    label = f"{case.name} cp={cp} rank={rank} causal={causal} heads={heads}"
    q, k, v, do = _inputs(case, hq, hkv, d, dv, dtype, device, seed)
    expected = _oracle(case, q, k, v, do, causal)
    cup = case.cu(device)[1]
    shard = lambda x: partition(x, cup, cp, rank)
    before = dict(ring_mod.path_counts)
    got = _run_ring(case, [shard(t) for t in (q, k, v, do)], causal, group, max_seqlen=bool(seed % 2))
    after = ring_mod.path_counts
    if cp > 1:
        # Reserved capacity alone is benign for the count path (spec 4.3): only slot padding
        # (or a padded tail slot) needs the exact per-rank counts.
        slot_padding = case.lens != case.slots
        path = "rank_counts" if slot_padding else "fast"
        other = "fast" if slot_padding else "rank_counts"
        assert after[path] == before.get(path, 0) + 1, f"{label}: expected the {path} path"
        assert after[other] == before.get(other, 0), f"{label}: took the {other} path"
    names = ("out", "lse", "dq", "dk", "dv")
    want = (shard(expected[0]), _partition_lse(expected[1], cup, cp, rank), *(shard(t) for t in expected[2:]))
    for name, g, w in zip(names, got, want, strict=True):
        kind = "grad" if name.startswith("d") else "out"
        assert_close(g, w, f"{label}: {name}", **tolerance(dtype, kind))
    pad_rows = shard(case.padding_rows(device))
    for name, g in zip(names, got, strict=True):
        if name == "lse":
            assert_rows_equal(g, pad_rows, float("-inf"), f"{label}: lse", dim=1)
        else:
            assert_rows_equal(g, pad_rows, 0.0, f"{label}: {name} padding rows")
    if case.padded:  # NaN in every padding row of every input changes nothing, bit for bit
        poisoned = [t.clone() for t in (q, k, v, do)]
        for t in poisoned:
            t[case.padding_rows(device)] = float("nan")
        again = _run_ring(case, [shard(t) for t in poisoned], causal, group, max_seqlen=True)
        for name, g, a in zip(names, got, again, strict=True):
            assert torch.equal(g, a), f"{label}: {name} changed when padding rows of the inputs hold NaN"


# ----------------------------------------------------------------------------- spawned workers


def _worker_matrix(rank: int, world: int, device: str, scale: int, dtype: torch.dtype) -> None:
    seed = 0
    for case in cases(world, scale):
        for causal in (True, False):
            for heads in _HEADS if case.name in ("nopad", "middle") else _HEADS[:1]:
                seed += 1
                _check_case(case, world, rank, None, causal, heads, dtype, device, seed)
    # Low precision: bf16 shards, fp32 merge, bf16 dq/dk/dv sums.
    for causal in (True, False):
        _check_case(cases(world, scale)[3], world, rank, None, causal, _HEADS[0], torch.bfloat16, device, 99)
    # cp = 1 through the same API, on a one-rank subgroup.
    singles = [dist.new_group([r]) for r in range(world)]
    for case in cases(1, scale)[:4]:
        _check_case(case, 1, 0, singles[rank], True, _HEADS[0], dtype, device, 100)
    _check_fast_path_is_wrong_with_padding(rank, world, device, dtype)


def _check_fast_path_is_wrong_with_padding(rank: int, cp: int, device: str, dtype: torch.dtype) -> None:
    """Sensitivity check: forcing the fast path on ``[2m, m]`` in ``[2m, 2m]`` must be wrong."""
    case = cases(cp)[2]
    q, k, v, do = _inputs(case, 2, 2, 16, 16, dtype, device, 7)
    expected = _oracle(case, q, k, v, do, True)[0]
    cup = case.cu(device)[1]
    shards = [partition(t, cup, cp, rank) for t in (q, k, v, do)]
    out = _run_ring(case, shards, True, None, max_seqlen=True, pad=False)[0]
    same = torch.allclose(out, partition(expected, cup, cp, rank), atol=1e-3)
    wrong = torch.tensor([0.0 if same else 1.0], device=device)
    dist.all_reduce(wrong)
    assert wrong.sum() > 0 or cp == 1, "the cu // cp fast path unexpectedly matched a padded layout"


def _worker_errors(rank: int, world: int) -> None:
    m = 2 * world
    q = torch.randn(m, 2, 16)
    # Slots divisible by 2*(world/2) but not by 2*world: the layout was built for a smaller group.
    cu = torch.tensor([0, world], dtype=torch.int32)
    with pytest.raises(ThdValueError, match=rf"multiple of 2\*cp_size = {m}"):
        ring_attention(q[: world // 2], q[: world // 2], q[: world // 2], cu, cu, cu, cu)
    # Causal needs q and k/v shards with the same rows.
    cup = torch.tensor([0, m * 2], dtype=torch.int32)
    with pytest.raises(ThdValueError, match="same number of rows"):
        ring_attention(q[:4], q[:2], q[:2], cu, cu, cup, cup)
    # Shards that differ across ranks are reported on every rank (no hang).
    extra = 2 if rank == 1 else 0
    qs = torch.randn(4 + extra, 2, 16)
    with pytest.raises(ThdValueError, match="shard shapes differ across the group"):
        ring_attention(qs, qs, qs, cu, cu, cup, cup, causal=False)
    # A rank-local metadata error is raised there and reported as ThdDistributedError elsewhere.
    bad = torch.randn(4, 3, 16) if rank == 0 else torch.randn(4, 2, 16)
    kv = torch.randn(4, 2, 16)
    expected = ThdValueError if rank == 0 else ThdDistributedError
    with pytest.raises(expected):
        ring_attention(bad, kv, kv, cu, cu, cup, cup)


# ----------------------------------------------------------------------------- CPU tests


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_reference_gloo(world: int) -> None:
    spawn(_worker_matrix, world, "cpu", 1, torch.float32, timeout_s=150)


def _worker_triton_interpreter(rank: int, world: int) -> None:
    """The real ring (gloo) with attention through the Triton kernels in the interpreter: the
    in-kernel accumulation of the later steps, the per-step offsets and the grid bounds."""
    os.environ["TRITON_INTERPRET"] = "1"  # the spawn entry dropped it; Triton reads it at decoration
    from thd._runtime import tiles

    assert tiles.SETTINGS.interpret, "the Triton kernels were not decorated for the interpreter"
    os.environ["THD_ATTENTION_BACKEND"] = "triton"
    seed = 200
    for case in (cases(world)[3], cases(world)[2], Case("big-slot", (3, 2, 5), (4, 40, 8))):
        for causal in (True, False):
            seed += 1
            _check_case(case, world, rank, None, causal, (2, 1, 32, 32), torch.float32, "cpu", seed)


@pytest.mark.distributed
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_ring_through_triton_interpreter_gloo() -> None:
    spawn(_worker_triton_interpreter, 2, timeout_s=300)


@pytest.mark.distributed
def test_rejects_bad_group_layout_and_shards_gloo() -> None:
    spawn(_worker_errors, 4, timeout_s=150)  # 4 ranks importing torch on 2 loaded cores


def test_rejects_missing_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.randn(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ThdDistributedError, match="not initialized"):
        ring_attention(q, q, q, cu, cu, cu, cu)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_simulation_matches_reference(cp: int, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    rng = random.Random(cp * 10 + causal)
    layouts = cases(cp)
    for i in range(4):  # random layouts: lengths 0..3m, slots rounded up, sometimes extra padding
        lens = [rng.choice([0, 1, rng.randrange(0, 6 * cp)]) for _ in range(rng.randrange(1, 5))]
        slots = [_round_up(n, 2 * cp) + 2 * cp * rng.randrange(0, 2) for n in lens]
        layouts.append(Case(f"random{i}", tuple(lens), tuple(slots)))
    for case in layouts:
        if case.capacity:
            continue  # reserved capacity is covered by the spawned tests
        q, k, v, do = _inputs(case, 4, 2, 16, 8, torch.float32, "cpu", cp)
        out, _, dq, dk, dv = _oracle(case, q, k, v, do, causal)
        cu, cup = case.cu()
        sim = simulate_ring_attention(
            q, k, v, cu, cu, cup, cup, cp_size=cp, causal=causal, pad_between_seqs=case.padded, do=do
        )
        for name, want in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert_close(
                sim.gather(name, cup), want, f"{case.name} cp={cp}: {name}", **tolerance(torch.float32)
            )


@pytest.mark.parametrize(
    ("cp", "lens", "slots", "causal"),
    [
        (2, (7, 9, 1, 0, 13), (8, 12, 4, 0, 16), True),
        (2, (40, 3), (40, 8), True),
        (2, (7, 9, 1, 0, 13), (8, 12, 4, 0, 16), False),
        (4, (45, 1, 0, 6), (48, 8, 8, 8), True),
        (2, (3, 2, 5), (4, 40, 8), True),  # a slot far longer than the longest real length
    ],
    ids=["middle-causal", "short-tail-causal", "middle-full", "cp4-tail-short-causal", "big-slot-causal"],
)
def test_ring_simulation_through_triton_kernels(
    cp: int, lens: tuple[int, ...], slots: tuple[int, ...], causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-step offsets and length bounds through the real kernels (interpreter on CPU).

    Odd ranks get the tightened ``max_slot`` bounds, even ranks the plain ``max_seqlen`` ones;
    NaN in every padding row of the inputs must not change a single bit.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter lane only (the nccl test covers the kernels on GPUs)")
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "triton")
    case = Case("kernels", lens, slots)
    device = "cpu"
    q, k, v, do = _inputs(case, 2, 1, 32, 32, torch.float32, device, cp)
    out, _, dq, dk, dv = _oracle(case, q, k, v, do, causal)
    cu, cup = case.cu(device)

    def run(q: Tensor, k: Tensor, v: Tensor, do: Tensor):
        return simulate_ring_attention(q, k, v, cu, cu, cup, cup, cp_size=cp, causal=causal, do=do)

    sim = run(q, k, v, do)
    for name, want in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(sim.gather(name, cup), want, f"cp={cp}: {name}", **tolerance(torch.float32, "grad"))
    poisoned = [t.clone() for t in (q, k, v, do)]
    for t in poisoned:
        t[case.padding_rows(device)] = float("nan")
    again = run(*poisoned)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(sim.gather(name, cup), again.gather(name, cup)), f"cp={cp}: {name} saw NaN padding"


def test_fast_path_counts_are_wrong_with_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why padding must never take ``cu // cp``: spec §2.5's ``[8, 4]`` in ``[8, 8]`` at cp=2."""
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    case = cases(2)[2]
    q, k, v, do = _inputs(case, 2, 2, 16, 16, torch.float32, "cpu", 3)
    cu, cup = case.cu()
    out = _oracle(case, q, k, v, do, True)[0]
    fast = simulate_ring_attention(q, k, v, cu, cu, cup, cup, cp_size=2, pad_between_seqs=False)
    exact = simulate_ring_attention(q, k, v, cu, cu, cup, cup, cp_size=2, pad_between_seqs=True)
    assert not torch.allclose(fast.gather("out", cup), out, atol=1e-3)
    assert_close(exact.gather("out", cup), out, "exact out", **tolerance(torch.float32))


# ----------------------------------------------------------------------------- GPU tests


def _worker_gpu_matrix(rank: int, world: int) -> None:
    device = f"cuda:{rank}"
    seed = 0
    for case in cases(world, scale=64):
        for causal in (True, False):
            seed += 1
            for heads in ((8, 2, 128, 128), (8, 8, 128, 64)):
                _check_case(case, world, rank, None, causal, heads, torch.bfloat16, device, seed)
    singles = [dist.new_group([r]) for r in range(world)]  # cp = 1 through the same API
    for case in cases(1, scale=64)[:4]:
        _check_case(case, 1, 0, singles[rank], True, (8, 2, 128, 128), torch.bfloat16, device, 50)
    _worker_cuda_graph(rank, world)


def _worker_cuda_graph(rank: int, world: int) -> None:
    """Capture forward+backward once, replay with new cu_seqlens values and new data."""
    device = torch.device("cuda", rank)
    m = 2 * world
    layouts = [
        Case("graph-a", (700, 300, 24), (704, 304, 24)),
        Case("graph-b", (1024, 0, 4), (1024, 0, 8)),
        Case("graph-c", (8, 5, 1001), (8, 8, 1016)),
    ]
    rows = layouts[0].rows
    assert all(c.rows == rows and len(c.lens) == 3 and all(s % m == 0 for s in c.slots) for c in layouts)
    hq, hkv, d, dv = 8, 2, 128, 128
    cu_s, cup_s = (t.clone() for t in layouts[0].cu(device))
    q_s = torch.zeros(rows // world, hq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k_s = torch.zeros(rows // world, hkv, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v_s = torch.zeros(rows // world, hkv, dv, device=device, dtype=torch.bfloat16, requires_grad=True)
    do_s = torch.zeros(rows // world, hq, dv, device=device, dtype=torch.bfloat16)

    def load(case: Case, seed: int):
        q, k, v, do = _inputs(case, hq, hkv, d, dv, torch.bfloat16, str(device), seed)
        cu, cup = case.cu(device)
        cu_s.copy_(cu)
        cup_s.copy_(cup)
        with torch.no_grad():
            for dst, src in zip((q_s, k_s, v_s, do_s), (q, k, v, do), strict=True):
                dst.copy_(partition(src, cup, world, rank))
        return q, k, v, do

    def step() -> Tensor:
        out = ring_attention(
            q_s, k_s, v_s, cu_s, cu_s, cup_s, cup_s, causal=True, pad_between_seqs=True,
            max_seqlen_q=rows, max_seqlen_kv=rows,
        )  # fmt: skip
        out.backward(do_s)
        return out

    load(layouts[0], 1)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
            q_s.grad = k_s.grad = v_s.grad = None
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")  # eager forward+backward: no host sync at all
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    q_s.grad = k_s.grad = v_s.grad = None
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = step()
    for seed, case in enumerate(layouts, start=2):
        q, k, v, do = load(case, seed)
        graph.replay()
        torch.cuda.synchronize(device)
        expected = _oracle(case, q, k, v, do, True)
        cup = case.cu(device)[1]
        for name, got, want in (("out", out_s, expected[0]), ("dq", q_s.grad, expected[2]),
                                ("dk", k_s.grad, expected[3]), ("dv", v_s.grad, expected[4])):  # fmt: skip
            kind = "grad" if name.startswith("d") else "out"
            assert_close(got, partition(want, cup, world, rank), f"graph {case.name}: {name}",
                         **tolerance(torch.bfloat16, kind))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 CUDA devices")
def test_ring_matches_reference_nccl() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    spawn(_worker_gpu_matrix, 2, backend="nccl", timeout_s=600)
