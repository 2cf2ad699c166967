"""Every rank of the ring in one process, one thread per rank, exchanging real tensors.

:class:`ThreadComm` stands in for :class:`thd.cp.comm.RingComm` (``send``/``recv``/``start``/
``wait``): a send queues a copy of its tensor in a mailbox keyed by (source, destination, tag),
first in first out as NCCL and gloo match them; a receive copies the oldest matching message into
its buffer. One lock is held by whichever rank thread runs host code and released only while a
rank waits for a message, so host work never interleaves (Triton's caches see one caller at a
time), and on CUDA every copy is queued on the device's one default stream after the work that
produced its tensor. :func:`run_ring` runs :mod:`thd.cp.ring`'s own forward and backward loops
for all ranks (without autograd: its CUDA worker thread would wait on a rank thread's lock), so
one GPU can check the ring's exchanges, windowed schedule and sinks at realistic sizes against
single-device attention. :class:`SelfComm` and :func:`one_rank_ring` run one rank alone in the
calling thread (autograd and CUDA-graph capture included).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

TIMEOUT_S = float(os.environ.get("THD_THREAD_RING_TIMEOUT_S", "300"))
"""How long :func:`run_ranks` waits for its rank threads before it fails with their stacks (below
pytest's own ``--timeout``, the stacks land in the test's failure message)."""


@dataclass
class _Hub:
    """Mailboxes shared by the ranks, and the lock that lets one rank thread run at a time."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    boxes: dict[tuple[int, int, int], deque[Tensor]] = field(default_factory=dict)
    failed: bool = False


@dataclass(frozen=True)
class _Op:
    send: bool
    tensor: Tensor
    peer: int
    tag: int


class _Pending:
    def __init__(self, hub: _Hub, rank: int, receives: list[_Op]) -> None:
        self.hub, self.rank, self.receives = hub, rank, receives

    def wait(self) -> None:
        """Copy each expected message into its buffer, waiting (lock released) until it is sent."""
        hub = self.hub
        for op in self.receives:
            box = hub.boxes.setdefault((op.peer, self.rank, op.tag), deque())
            if not hub.cond.wait_for(lambda box=box: bool(box) or hub.failed, timeout=TIMEOUT_S):
                raise TimeoutError(f"rank {self.rank}: no message from rank {op.peer} with tag {op.tag}")
            if hub.failed:
                raise RuntimeError(f"rank {self.rank}: another rank failed")
            op.tensor.copy_(box.popleft())
        self.receives = []


class ThreadComm:
    """Rank ``rank`` of ``size`` ranks that run as threads of this process."""

    transport = "threads"

    def __init__(self, hub: _Hub, size: int, rank: int) -> None:
        self.hub, self.size, self.rank = hub, size, rank

    def send(self, tensor: Tensor, offset: int, tag: int) -> _Op:
        return _Op(True, tensor, (self.rank + offset) % self.size, tag)

    def recv(self, tensor: Tensor, offset: int, tag: int) -> _Op:
        return _Op(False, tensor, (self.rank + offset) % self.size, tag)

    def start(self, ops: Sequence[_Op]) -> _Pending:
        """Post the sends (a copy of each tensor as it is now); the receives complete in ``wait``."""
        for op in ops:
            if op.send:
                self.hub.boxes.setdefault((self.rank, op.peer, op.tag), deque()).append(op.tensor.clone())
        self.hub.cond.notify_all()
        return _Pending(self.hub, self.rank, [op for op in ops if not op.send])


def _stacks(threads: Sequence[threading.Thread]) -> str:
    """Where each of ``threads`` is now (a hung kernel shows as a rank blocked in a CUDA call, a
    lost message as a rank waiting in :meth:`_Pending.wait`)."""
    frames = sys._current_frames()
    parts = []
    for thread in threads:
        frame = frames.get(thread.ident) if thread.ident is not None else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (no frame)\n"
        parts.append(f"{thread.name}:\n{stack}")
    return "".join(parts)


def run_ranks(size: int, body: Callable[[int, ThreadComm], Any]) -> list[Any]:
    """``[body(rank, comm) for rank in range(size)]``, the ranks running concurrently as threads."""
    hub = _Hub()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        with hub.cond:
            try:
                results[rank] = body(rank, ThreadComm(hub, size, rank))
            except BaseException as exc:  # reported to the caller; the other ranks stop waiting
                errors.append(exc)
                hub.failed = True
                hub.cond.notify_all()

    threads = [
        threading.Thread(target=run, args=(rank,), name=f"rank {rank}", daemon=True) for rank in range(size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    if errors:
        raise errors[0]
    alive = [thread for thread in threads if thread.is_alive()]
    if alive:
        raise TimeoutError(f"ring threads still running after {TIMEOUT_S} s:\n{_stacks(alive)}")
    undelivered = sum(len(box) for box in hub.boxes.values())
    assert undelivered == 0, f"{undelivered} messages sent but never received"
    return results


def run_ring(
    plans: Sequence[Any], shards: Sequence[Sequence[Tensor]], sinks: Tensor | None
) -> list[tuple[Tensor, ...]]:
    """Per rank ``(out, lse, dq, dk, dv, dsinks part)`` of the ring's forward and backward loops.

    ``plans[r]`` is rank ``r``'s :class:`thd.cp.plan.RingPlan`; ``shards[r] = (q, k, v, do)``."""
    from thd.cp.ring import _forward, _ring_backward

    size = len(plans)
    forward = run_ranks(size, lambda r, comm: _forward(*shards[r][:3], sinks, plans[r], comm, True))

    def backward(r: int, comm: ThreadComm) -> tuple[Tensor, ...]:
        q, _, _, do = shards[r]
        out, lse, k_last, v_last = forward[r]
        return _ring_backward(do, (q, k_last, v_last, out, lse, sinks), plans[r], comm, True)  # type: ignore[arg-type]

    grads = run_ranks(size, backward)
    return [(f[0], f[1], *g) for f, g in zip(forward, grads, strict=True)]


class SelfComm:
    """A rank alone: every exchange hands the rank back the tensors it sent (by tag; NaN, which
    its own padding rows hold, as 0: another rank's block has its real rows where this one may
    have padding), so the ring runs its own loops, forward and backward under autograd, on
    deterministic data in one thread. The values are not a real ring's: it serves to compare
    two ways of running the same call."""

    transport = "self"

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank

    def send(self, tensor: Tensor, offset: int, tag: int) -> tuple[bool, Tensor, int]:
        return True, tensor, tag

    def recv(self, tensor: Tensor, offset: int, tag: int) -> tuple[bool, Tensor, int]:
        return False, tensor, tag

    def start(self, ops: list[tuple[bool, Tensor, int]]) -> SelfComm:
        sent = {tag: t for is_send, t, tag in ops if is_send}
        for is_send, t, tag in ops:
            if not is_send:
                t.copy_(sent[tag].nan_to_num(0.0))
        return self

    def wait(self) -> None:
        """Every receive completed in ``start``."""


def one_rank_ring(monkeypatch: pytest.MonkeyPatch, comm: Callable[[], Any]) -> None:
    """Make :func:`thd.cp.ring_attention` run without a process group, its exchanges through
    ``comm()`` and no validation reads (which would gather over the group)."""
    import thd.cp.ring as ring_mod

    monkeypatch.setattr(ring_mod, "resolve_group", lambda fn, group: group)
    monkeypatch.setattr(ring_mod, "ring_comm", lambda group, like: comm())
    monkeypatch.setattr(ring_mod, "_host_reads_allowed", lambda *args: False)


def rank0_of_two_alone(monkeypatch: pytest.MonkeyPatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rank 0 of a 2-rank ring run alone on the tl kernels (CPU: the interpreter), through
    :class:`SelfComm`; its ``q, k, v, do``: that rank's half of 16 rows, 2 heads of 16, seeded."""
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("THD_KERNELS", "tl")
    comm = SelfComm(2, 0)
    one_rank_ring(monkeypatch, lambda: comm)
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(8, 2, 16, generator=gen) for _ in range(4))
    return q, k, v, do
