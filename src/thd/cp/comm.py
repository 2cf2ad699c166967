"""Point-to-point ring exchanges over ``torch.distributed``: the one home of stream and order rules.

Which communicator carries the exchanges (the user's group, a high-priority NCCL communicator
derived from it, or symmetric memory) is chosen by :func:`thd.cp.transport.ring_comm`; this
module is the plain ``torch.distributed`` transport they share.

Rules (everything in :mod:`thd.cp.ring` goes through :class:`RingComm`):

- Every exchange is one ``dist.batch_isend_irecv`` call, so the sends and receives of a ring
  step form one NCCL group and can never deadlock against each other, whatever the number of
  ranks (cp = 2 included, where "next" and "previous" are the same peer).
- Messages between two ranks are posted in the same order on both sides; each carries a tag
  derived from the ring step and message kind so gloo matches them by tag as well.
- On CUDA the operations are issued from a side stream that first waits for the current
  stream, so every buffer written, read or freed by work queued before the exchange is safe
  (this also forks the side stream correctly during CUDA-graph capture). :meth:`Pending.wait`
  makes the current stream wait for the communication and joins the side stream back; it never
  blocks the host on CUDA (gloo waits on the host).
- Overlap comes from posting the exchange of step ``i + 1`` before queuing the compute of step
  ``i`` and waiting for it only after.
- On NCCL a batch is posted straight through the group's coalescing calls
  (``_start_coalescing``/``send``/``recv``/``_end_coalescing``, what ``batch_isend_irecv`` does
  after its argument checks), which saves host time per exchange; other backends, and torch
  builds without those calls, go through ``dist.batch_isend_irecv``.

Host time (issue 12): an exchange is described by :class:`P2P` records (``dist.P2POp``'s
fields without its per-op group and argument resolution, several microseconds each), turned
into ``dist.P2POp`` only for ``batch_isend_irecv``. The fork onto the side stream and the join
back record one cached event per (device, stream) instead of a new one per ``wait_stream``, and
switch the current stream with ``torch.cuda.set_stream`` instead of a ``StreamContext``.
Reusing an event is safe: a wait captures the event's latest record when it is issued, eagerly
and during CUDA-graph capture alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from thd._runtime.config import cp_side_stream
from thd.errors import ThdDistributedError

__all__ = ["P2P", "Pending", "RingComm", "all_gather_ints", "resolve_group", "side_stream", "wait_stream"]

_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_EVENTS: dict[tuple[int, int], torch.cuda.Event] = {}


def side_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream | None:
    """The cached communication stream of a CUDA device and priority (lower is more urgent;
    ``THD_CP_SIDE_STREAM=0`` disables the side stream of the NCCL/gloo transport)."""
    if device.type != "cuda" or (priority == 0 and not cp_side_stream()):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get((index, priority))
    if stream is None:
        stream = torch.cuda.Stream(device=index, priority=priority)
        _SIDE_STREAMS[(index, priority)] = stream
    return stream


def wait_stream(waiter: torch.cuda.Stream, producer: torch.cuda.Stream) -> None:
    """``waiter.wait_stream(producer)`` through the cached event of ``producer`` (one per
    (device, stream), never a new one per call)."""
    key = (producer.device_index, producer.cuda_stream)
    event = _EVENTS.get(key)
    if event is None:
        if len(_EVENTS) >= 256:  # streams come and go: keep the cache bounded
            _EVENTS.clear()
        event = _EVENTS[key] = torch.cuda.Event()
    event.record(producer)
    waiter.wait_event(event)


def all_gather_ints(group: dist.ProcessGroup, device: torch.device, values: Sequence[int]) -> list[list[int]]:
    """Every member's ``values`` (same length on every rank), by group rank: one small
    ``all_gather`` over ``group`` and one device-to-host read."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).tolist()


class P2P:
    """One send or receive of an exchange: ``dist.P2POp``'s fields (``op`` is ``dist.isend`` or
    ``dist.irecv``, ``peer`` a global rank), without its per-op argument resolution."""

    __slots__ = ("group", "op", "peer", "tag", "tensor")

    def __init__(self, op: object, tensor: Tensor, peer: int, group: dist.ProcessGroup, tag: int) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag

    def p2p_op(self) -> dist.P2POp:
        """The ``dist.P2POp`` of this record (for ``dist.batch_isend_irecv``)."""
        return dist.P2POp(self.op, self.tensor, self.peer, self.group, self.tag)  # type: ignore[arg-type]


def resolve_group(fn: str, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group`` or the default group; :class:`ThdDistributedError` when there is none."""
    if not dist.is_available():
        raise ThdDistributedError(f"{fn}: group: torch.distributed is not available in this build of torch")
    if not dist.is_initialized():
        raise ThdDistributedError(
            f"{fn}: group: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (cp=1 still needs a process group)"
        )
    resolved = dist.group.WORLD if group is None else group
    if resolved is not None and _MEMBER_OF.get(id(resolved)) is resolved:
        return resolved  # membership never changes: checked once per group
    if resolved is None or dist.get_rank(resolved) < 0:
        raise ThdDistributedError(
            f"{fn}: group: this process (global rank {dist.get_rank()}) is not a member of the group"
        )
    if len(_MEMBER_OF) >= 64:
        _MEMBER_OF.clear()
    _MEMBER_OF[id(resolved)] = resolved  # a strong reference: the id cannot be reused while cached
    return resolved


_MEMBER_OF: dict[int, dist.ProcessGroup] = {}


@dataclass
class Pending:
    """Outstanding operations of one exchange; keeps their tensors alive until :meth:`wait`."""

    works: list[dist.Work] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    stream: torch.cuda.Stream | None = None
    current: torch.cuda.Stream | None = None
    """The stream that was current when the exchange was posted, if known (the one that waits:
    the ring waits within the call that posted, on the same stream)."""

    def wait(self) -> None:
        """Order the current stream after the exchange (host wait on CPU/gloo). Idempotent."""
        for work in self.works:
            work.wait()
        if self.stream is not None:
            current = self.current
            wait_stream(
                torch.cuda.current_stream(self.stream.device) if current is None else current, self.stream
            )
        self.works.clear()
        self.tensors.clear()
        self.stream = self.current = None


class RingComm:
    """Sends to the next rank and receives from the previous one (or the reverse) in a group.

    ``group`` is the user's group: it defines the ring order (its group ranks) and carries the
    collectives of the argument checks. ``p2p_group`` carries the sends and receives: the same
    group, or a communicator with the same members derived from it (see
    :mod:`thd.cp.transport`). ``transport`` and ``reason`` say which one and why.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        p2p_group: dist.ProcessGroup | None = None,
        *,
        transport: str = "",
        reason: str = "",
    ) -> None:
        self.group = group
        self.p2p_group = group if p2p_group is None else p2p_group
        self.transport = transport or "group"
        self.reason = reason
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)]
        self._p2p_rank = {g: dist.get_group_rank(self.p2p_group, g) for g in self.global_ranks}
        self._coalesce: bool | None = None  # whether the lean coalesced NCCL path applies (per device type)

    def __repr__(self) -> str:
        return f"RingComm(size={self.size}, rank={self.rank}, transport={self.transport!r})"

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places after this one (mod size)."""
        return self.global_ranks[(self.rank + offset) % self.size]

    def send(self, tensor: Tensor, offset: int, tag: int) -> P2P:
        """An isend of ``tensor`` to the member ``offset`` places away (``+1`` next, ``-1`` previous)."""
        return P2P(
            dist.isend, tensor, self.global_ranks[(self.rank + offset) % self.size], self.p2p_group, tag
        )

    def recv(self, tensor: Tensor, offset: int, tag: int) -> P2P:
        """An irecv into ``tensor`` from the member ``offset`` places away."""
        return P2P(
            dist.irecv, tensor, self.global_ranks[(self.rank + offset) % self.size], self.p2p_group, tag
        )

    def start(self, ops: Sequence[P2P | dist.P2POp]) -> Pending:
        """Post ``ops`` as one batch (one NCCL group); returns the :class:`Pending` handle."""
        if not ops:
            return Pending()
        tensors = [op.tensor for op in ops]
        device = tensors[0].device
        stream = side_stream(device)
        if stream is None:
            return Pending(self._post(ops, device), tensors)
        current = torch.cuda.current_stream(device)
        wait_stream(stream, current)  # buffers produced/freed by queued work are safe; forks under capture
        if current.device_index != torch.cuda.current_device():
            with torch.cuda.stream(stream):  # another device's stream: the context switches devices
                works = self._post(ops, device)
        else:
            torch.cuda.set_stream(stream)
            try:
                works = self._post(ops, device)
            finally:
                torch.cuda.set_stream(current)
        return Pending(works, tensors, stream, current)

    def _post(self, ops: Sequence[P2P | dist.P2POp], device: torch.device) -> list[dist.Work]:
        """Issue ``ops`` as one coalesced batch on ``p2p_group`` (from the current stream)."""
        group = self.p2p_group
        if self._coalesce is None:
            self._coalesce = _can_coalesce(group, device)
        if not self._coalesce:
            return list(dist.batch_isend_irecv([op.p2p_op() if isinstance(op, P2P) else op for op in ops]))
        group._start_coalescing(device)
        try:
            for op in ops:
                peer = self._p2p_rank[op.peer]
                if op.op is dist.isend:
                    group.send([op.tensor], peer, op.tag)
                else:
                    group.recv([op.tensor], peer, op.tag)
        finally:
            work = group._end_coalescing(device)
        return [] if work is None else [work]


def _can_coalesce(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` on ``device`` is a plain NCCL-style group that coalesces P2P batches
    (what ``batch_isend_irecv`` checks before taking the same path)."""
    if device.type != "cuda" or type(group) is not dist.ProcessGroup:
        return False
    if not all(hasattr(group, name) for name in ("_start_coalescing", "_end_coalescing", "_get_backend")):
        return False
    try:
        return bool(group._get_backend(device).supports_coalescing)
    except (RuntimeError, AttributeError, ValueError):
        return False
