"""thd.cp.transport: which communicator carries the ring's exchanges, and that it changes nothing.

CPU lane (gloo): the selection logic, the per-group cache, the log line, the CUDA-graph-capture
fallback and the cross-rank agreement run for real; to reach the NCCL branches a gloo group
"pretends" to be NCCL (``_probe`` patched) and the derived communicator is a gloo group made
by the same ``dist.new_group(..., use_local_synchronization=True)`` call. GPU lane (2 GPUs,
nccl): every transport gives bit-identical outputs and gradients, the derived communicator has
high-priority streams, a bound default group derives through ``split_group``, a first call
under capture uses the group as given, and captured symmetric-memory exchanges replay exactly.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from _dist import cuda_devices, spawn
from torch import Tensor

from thd.cp import partition, ring_attention
from thd.cp import transport as tp
from thd.cp.symm_mem import SymmMemComm
from thd.errors import ThdValueError

# ----------------------------------------------------------------------------- helpers


class _Records(logging.Handler):
    """Collects the ``thd.cp`` log records of one process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        logger = logging.getLogger("thd.cp")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


def _pretend_nccl(high_priority: bool = False) -> None:
    """Make every group look like an unbound NCCL group and derive gloo groups instead."""
    tp._probe = lambda group, device: tp._Probe(high_priority=high_priority, timeout=None, bound=False)
    tp._DERIVE_BACKEND = "gloo"


def _layout(lens: list[int], cp: int, device: str | torch.device) -> tuple[Tensor, Tensor, int]:
    slots = [-(-n // (2 * cp)) * (2 * cp) for n in lens]
    cu, cup = [0], [0]
    for n, s in zip(lens, slots, strict=True):
        cu.append(cu[-1] + n)
        cup.append(cup[-1] + s)
    i32 = {"dtype": torch.int32, "device": device}
    return torch.tensor(cu, **i32), torch.tensor(cup, **i32), sum(slots)


def _ring(
    lens: list[int], heads: tuple[int, int, int], group, rank: int, cp: int, device, dtype, seed: int
) -> list[Tensor]:
    """``[out, lse, dq, dk, dv]`` of one ring call on this rank's shard of a seeded batch."""
    cu, cup, rows = _layout(lens, cp, device)
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(rows, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv, hq)]
    q, k, v, do = (partition(t, cup, cp, rank) for t in full)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(
        q, k, v, cu, cu, cup, cup, group=group, causal=True, max_seqlen_q=max(lens),
        max_seqlen_kv=max(lens), return_lse=True,
    )  # fmt: skip
    out.backward(do)
    return [out.detach(), lse, q.grad, k.grad, v.grad]


def _assert_identical(got: list[Tensor], want: list[Tensor], label: str) -> None:
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a, b), f"{label}: {name} differs from the group-as-given result"


# ----------------------------------------------------------------------------- CPU: no spawn


def test_requested_transport_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THD_CP_TRANSPORT", raising=False)
    assert tp.requested_transport() == "auto"
    for raw, want in (
        ("NCCL", "nccl"),
        (" nccl_high_priority ", "nccl-high-priority"),
        ("symm-mem", "symm-mem"),
    ):
        monkeypatch.setenv("THD_CP_TRANSPORT", raw)
        assert tp.requested_transport() == want
    monkeypatch.setenv("THD_CP_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ThdValueError, match="THD_CP_TRANSPORT='carrier-pigeon'"):
        tp.requested_transport()
    assert tp.AUTO in tp.TRANSPORTS and tp.AUTO != "auto"


# ----------------------------------------------------------------------------- CPU: spawned gloo


def _worker_selection(rank: int, world: int) -> None:
    logs = _Records()
    x = torch.zeros(4, 2, 8)
    world_group = dist.group.WORLD
    # gloo: the group as given, logged once, cached per group.
    comm = tp.ring_comm(world_group, x)
    assert comm.transport == "gloo" and comm.p2p_group is world_group, comm
    assert tp.ring_comm(world_group, x) is comm
    lines = logs.take()
    assert len(lines) == 1 and "gloo" in lines[0] and "THD_CP_TRANSPORT=auto" in lines[0], lines
    other = dist.new_group(list(range(world)))
    assert tp.ring_comm(other, x) is not comm and tp.ring_comm(other, x).p2p_group is other
    os.environ["THD_CP_TRANSPORT"] = "symm-mem"  # needs NCCL and CUDA: gloo stays gloo
    assert tp.ring_comm(world_group, x).transport == "gloo"
    os.environ["THD_CP_TRANSPORT"] = "bogus"
    with pytest.raises(ThdValueError):
        tp.ring_comm(world_group, x)
    del os.environ["THD_CP_TRANSPORT"]
    singles = [dist.new_group([r]) for r in range(world)]
    assert tp.ring_comm(singles[rank], x).transport == "none"
    logs.take()

    # The NCCL branches, with gloo standing in for NCCL.
    _pretend_nccl()
    tp.clear_cache()
    real_capturing = tp.is_capturing
    tp.is_capturing = lambda: True  # first call under capture: the group as given, nothing cached
    try:
        captured = tp.ring_comm(world_group, x)
        assert captured.transport == "nccl" and captured.p2p_group is world_group
        assert tp.ring_comm(world_group, x) is not captured  # not cached
    finally:
        tp.is_capturing = real_capturing
    lines = logs.take()
    assert len(lines) == 1 and "CUDA-graph capture" in lines[0], lines  # logged once per group

    counter = dist.distributed_c10d._world.group_count
    derived = tp.ring_comm(world_group, x)
    assert derived.transport == "nccl-high-priority", derived.reason
    assert derived.p2p_group is not world_group
    assert dist.get_process_group_ranks(derived.p2p_group) == list(range(world))
    assert tp.ring_comm(world_group, x) is derived  # cached
    os.environ["THD_CP_TRANSPORT"] = tp.AUTO
    assert tp.ring_comm(world_group, x) is derived  # auto shares the entry of what it resolves to
    del os.environ["THD_CP_TRANSPORT"]
    assert dist.distributed_c10d._world.group_count == counter  # user group numbering untouched
    lines = logs.take()
    assert len(lines) == 1 and "nccl-high-priority" in lines[0] and "derived" in lines[0], lines
    dist.new_group(list(range(world)))  # the user's next new_group still matches on every rank

    # The ring through the derived communicator is bit-identical to the group as given.
    lens = [13, 40, 7]
    posted = []
    start = derived.start
    derived.start = lambda ops: posted.append(len(ops)) or start(ops)  # type: ignore[method-assign]
    got = _ring(lens, (4, 2, 16), None, rank, world, "cpu", torch.float32, 1)
    assert posted == [4, 4, 4], f"ring_attention did not post its exchanges through ring_comm: {posted}"
    assert tp.ring_comm(world_group, x) is derived
    os.environ["THD_CP_TRANSPORT"] = "nccl"
    want = _ring(lens, (4, 2, 16), None, rank, world, "cpu", torch.float32, 1)
    assert tp.ring_comm(world_group, x).p2p_group is world_group
    del os.environ["THD_CP_TRANSPORT"]
    _assert_identical(got, want, "derived group")
    logs.take()

    # A group that already has high-priority streams is used as given.
    _pretend_nccl(high_priority=True)
    hp = dist.new_group(list(range(world)))
    comm = tp.ring_comm(hp, x)
    assert comm.transport == "nccl-high-priority" and comm.p2p_group is hp and "already" in comm.reason
    _pretend_nccl()

    # Ranks asking for different transports all fall back to the group as given (no hang).
    mixed = dist.new_group(list(range(world)))
    os.environ["THD_CP_TRANSPORT"] = "nccl" if rank == 0 else "auto"
    comm = tp.ring_comm(mixed, x)
    del os.environ["THD_CP_TRANSPORT"]
    assert comm.transport == "nccl" and comm.p2p_group is mixed and "different transports" in comm.reason

    # symm-mem needs CUDA tensors: falls back to the high-priority communicator, says why.
    logs.take()
    os.environ["THD_CP_TRANSPORT"] = "symm-mem"
    comm = tp.ring_comm(dist.new_group(list(range(world))), x)
    del os.environ["THD_CP_TRANSPORT"]
    assert comm.transport == "nccl-high-priority", comm.reason
    assert any("symm-mem transport unavailable" in line and "CUDA" in line for line in logs.take())

    # Ranks that know different numbers of groups could not rendezvous a new one: fall back.
    skewed = dist.new_group(list(range(world)))
    if rank == world - 1:
        dist.new_group([rank], use_local_synchronization=True)  # only this rank registers it
    comm = tp.ring_comm(skewed, x)
    assert comm.transport == "nccl" and comm.p2p_group is skewed, comm.reason
    assert "numbers of process groups" in comm.reason

    # The symmetric-memory exchange layout (no buffer needed to plan it).
    symm = SymmMemComm(world_group, torch.device("cpu"), None)
    k, v = torch.zeros(5, 2, 8), torch.zeros(5, 2, 4)
    kr, vr = torch.empty_like(k), torch.empty_like(v)
    ops = [symm.send(v, 1, 11), symm.send(k, 1, 10), symm.recv(vr, -1, 11), symm.recv(kr, -1, 10)]
    sends, recvs, offsets, total, src = symm._plan(ops)
    assert [id(op.tensor) for op in sends + recvs] == [id(t) for t in (k, v, kr, vr)]  # tag order
    assert offsets == [0, 512] and total == 1024 and src == (rank - 1) % world
    assert symm._plan([symm.send(k, 1, 10), symm.recv(vr, -1, 10)]) is None  # shapes differ
    assert symm._plan([symm.send(k, 1, 10)]) is None  # no matching receive


@pytest.mark.distributed
def test_transport_selection_gloo() -> None:
    spawn(_worker_selection, 2, timeout_s=150)


def _worker_overlapping_groups(rank: int, world: int) -> None:
    """Four ranks: {0, 1} and {2, 3} derive at the same time (other ranks never take part), then
    {1, 2} derives; {0, 1, 2}, whose members now know different numbers of groups, falls back to
    the group as given instead of hanging. Every ring result equals the group-as-given one."""
    _pretend_nccl()
    x = torch.zeros(1)

    def check(group, members: list[int], derived: bool, seed: int) -> None:
        if rank not in members:
            return
        r, cp = members.index(rank), len(members)
        got = _ring([9, 30, 2 * cp], (2, 1, 8), group, r, cp, "cpu", torch.float32, seed)
        comm = tp.ring_comm(group, x)
        if derived:
            assert comm.transport == "nccl-high-priority" and comm.p2p_group is not group, comm.reason
        else:
            assert comm.transport == "nccl" and "numbers of process groups" in comm.reason, comm.reason
        os.environ["THD_CP_TRANSPORT"] = "nccl"
        want = _ring([9, 30, 2 * cp], (2, 1, 8), group, r, cp, "cpu", torch.float32, seed)
        del os.environ["THD_CP_TRANSPORT"]
        _assert_identical(got, want, f"group {members}")

    a, b = dist.new_group([0, 1]), dist.new_group([2, 3])
    check(a, [0, 1], True, 5)
    check(b, [2, 3], True, 6)
    c = dist.new_group([1, 2])
    check(c, [1, 2], True, 7)
    d = dist.new_group([0, 1, 2])
    check(d, [0, 1, 2], False, 8)
    dist.new_group(list(range(world)))  # job-wide group numbering still matches on every rank


@pytest.mark.distributed
def test_groups_on_different_ranks_do_not_deadlock_gloo() -> None:
    spawn(_worker_overlapping_groups, 4, timeout_s=200)  # 4 ranks on a small CPU machine


# ----------------------------------------------------------------------------- GPU (2 GPUs, nccl)

_GPU_CASES = (([700, 300, 24], (8, 2, 128)), ([1024, 5, 1001], (8, 8, 64)))


def _deterministic() -> None:
    """The backward without dQ atomics, so that bit-for-bit comparisons are meaningful."""
    torch.use_deterministic_algorithms(True, warn_only=True)


def _gpu_results(rank: int, world: int, mode: str, group=None) -> list[list[Tensor]]:
    os.environ["THD_CP_TRANSPORT"] = mode
    device = torch.device("cuda", rank)
    try:
        return [
            _ring(lens, heads, group, rank, world, device, torch.bfloat16, 10 + i)
            for i, (lens, heads) in enumerate(_GPU_CASES)
        ]
    finally:
        del os.environ["THD_CP_TRANSPORT"]


def _worker_gpu_transports(rank: int, world: int, modes: tuple[str, ...]) -> None:
    _deterministic()
    logs = _Records()
    device = torch.device("cuda", rank)
    x = torch.zeros(1, device=device)
    world_group = dist.group.WORLD
    want = _gpu_results(rank, world, "nccl")
    os.environ["THD_CP_TRANSPORT"] = "nccl"
    assert tp.ring_comm(world_group, x).p2p_group is world_group
    for mode in modes:
        expected = tp.AUTO if mode == "auto" else mode
        got = _gpu_results(rank, world, mode)
        os.environ["THD_CP_TRANSPORT"] = mode
        comm = tp.ring_comm(world_group, x)
        assert comm.transport == expected, f"{mode}: got {comm.transport} ({comm.reason}); log: {logs.lines}"
        if expected == "nccl-high-priority":
            backend = comm.p2p_group._get_backend(device)
            assert comm.p2p_group is not world_group and backend.options.is_high_priority_stream
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_identical(g, w, f"{mode} case {i}")
    del os.environ["THD_CP_TRANSPORT"]
    if "symm-mem" in modes:
        _capture_replays_exactly(rank, world, "symm-mem")
    else:
        _capture_first_call_uses_group(rank, world)
        _capture_replays_exactly(rank, world, "nccl-high-priority")


def _graph_step(rank: int, world: int, group, state: dict[str, Tensor], lens: list[int]) -> Tensor:
    cu, cup = state["cu"], state["cup"]
    out = ring_attention(
        state["q"], state["k"], state["v"], cu, cu, cup, cup, group=group, causal=True,
        pad_between_seqs=True, max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
    )  # fmt: skip
    out.backward(state["do"])
    return out


def _graph_state(rank: int, world: int, lens: list[int]) -> dict[str, Tensor]:
    device = torch.device("cuda", rank)
    cu, cup, rows = _layout(lens, world, device)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(rows, h, 128, generator=g).to(device, torch.bfloat16) for h in (8, 2, 2, 8)]
    q, k, v, do = (partition(t, cup, world, rank) for t in full)
    return {"cu": cu, "cup": cup, "q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_(),
            "do": do}  # fmt: skip


def _eager_warmup(fn, device: torch.device) -> None:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def _capture_first_call_uses_group(rank: int, world: int) -> None:
    """A group whose first ring call is captured: the group as given for that call; the replay
    equals the eager result; the next eager call derives the high-priority communicator."""
    device = torch.device("cuda", rank)
    lens = [700, 300, 24]
    state = _graph_state(rank, world, lens)
    fresh = dist.new_group(list(range(world)))
    # Its communicator and P2P connections exist before capture (an exchange outside the ring).
    buf, got = torch.ones(4, device=device), torch.empty(4, device=device)
    peer = (rank + 1) % world
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer, fresh),
                                        dist.P2POp(dist.irecv, got, peer, fresh)]):  # fmt: skip
        work.wait()
    _eager_warmup(lambda: _graph_step(rank, world, None, state, lens), device)  # kernels compiled
    for n in "qkv":
        state[n].grad = None
    eager = _graph_step(rank, world, None, state, lens).detach().clone()
    grads = [state[n].grad.clone() for n in "qkv"]
    for n in "qkv":
        state[n].grad = None
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _graph_step(rank, world, fresh, state, lens)
    x = torch.zeros(1, device=device)
    assert tp.ring_comm(fresh, x).transport == "nccl-high-priority"  # eager now: derived
    for _ in range(2):
        for n in "qkv":
            state[n].grad.zero_()
        graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, eager), "captured output (group as given) differs from eager"
    for n, g in zip("qkv", grads, strict=True):
        assert torch.equal(state[n].grad, g), f"captured d{n} differs from eager"


def _capture_replays_exactly(rank: int, world: int, mode: str) -> None:
    """Eager warm-up (buffers and communicators made), then capture and replay under ``mode``."""
    os.environ["THD_CP_TRANSPORT"] = mode
    device = torch.device("cuda", rank)
    lens = [1000, 24, 5]
    state = _graph_state(rank, world, lens)
    try:
        _eager_warmup(lambda: _graph_step(rank, world, None, state, lens), device)
        for n in "qkv":
            state[n].grad = None
        eager = _graph_step(rank, world, None, state, lens).detach().clone()
        grads = [state[n].grad.clone() for n in "qkv"]
        for n in "qkv":
            state[n].grad = None
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _graph_step(rank, world, None, state, lens)
        for _ in range(3):
            for n in "qkv":
                state[n].grad.zero_()
            graph.replay()
        torch.cuda.synchronize(device)
    finally:
        del os.environ["THD_CP_TRANSPORT"]
    assert torch.equal(out, eager), f"{mode}: replayed output differs from eager"
    for n, g in zip("qkv", grads, strict=True):
        assert torch.equal(state[n].grad, g), f"{mode}: replayed d{n} differs from eager"


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 CUDA devices")
def test_high_priority_transport_is_bit_identical_nccl() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    spawn(_worker_gpu_transports, 2, ("nccl-high-priority", "auto"), backend="nccl", timeout_s=400)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 CUDA devices")
def test_symm_mem_transport_is_bit_identical_nccl() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    spawn(_worker_gpu_transports, 2, ("symm-mem",), backend="nccl", timeout_s=300)


def _worker_gpu_bound(rank: int, world: int) -> None:
    """A default group bound to its device (init_process_group(device_id=...)): split_group.

    The group is created bound (not destroyed and re-created: torch <= 2.11 dereferences a null
    pointer in split() of a default group that is not the process's first NCCL group,
    pytorch/pytorch#192109)."""
    _deterministic()
    device = torch.device("cuda", rank)
    want = _gpu_results(rank, world, "nccl")
    got = _gpu_results(rank, world, "nccl-high-priority")
    os.environ["THD_CP_TRANSPORT"] = "nccl-high-priority"
    comm = tp.ring_comm(dist.group.WORLD, torch.zeros(1, device=device))
    del os.environ["THD_CP_TRANSPORT"]
    assert comm.transport == "nccl-high-priority" and "split_group" in comm.reason, comm.reason
    assert comm.p2p_group._get_backend(device).options.is_high_priority_stream
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_identical(g, w, f"bound default group, case {i}")


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 CUDA devices")
def test_bound_default_group_derives_by_split_nccl() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    spawn(_worker_gpu_bound, 2, backend="nccl", timeout_s=400, bind_device=True)
