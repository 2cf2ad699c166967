"""The ``symm-mem`` ring transport: copy-engine pulls through ``torch.distributed._symmetric_memory``.

The sender copies its tensors into its symmetric buffer; after a barrier the receiver pulls them
from the peer's buffer with ``copy_`` (a DMA, no SMs) on a high-priority side stream, followed by
a second barrier. :func:`thd.cp.transport.ring_comm` decides when this transport is used
(``THD_CP_TRANSPORT=symm-mem``) and falls back when :func:`unavailable_reason` or
:func:`symm_mem_comm` says it cannot be.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from thd._capture import is_capturing
from thd.cp.comm import P2P, Pending, RingComm, all_gather_ints, side_stream, wait_stream

__all__ = ["SymmMemComm", "symm_mem_comm", "unavailable_reason"]


def unavailable_reason(device: torch.device) -> str | None:
    """Why symmetric memory cannot be used on this rank (None: a local allocation works)."""
    if device.type != "cuda":
        return "needs CUDA tensors"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(4096, dtype=torch.uint8, device=device)
        del buf
    except Exception as exc:
        return f"cannot allocate symmetric memory ({type(exc).__name__}: {exc})"
    return None


def symm_mem_comm(
    group: dist.ProcessGroup, device: torch.device, timeout: timedelta | None
) -> RingComm | str:
    """A :class:`SymmMemComm` with a first buffer rendezvoused on every rank, or why not
    (collective over ``group``: every member calls it, or none)."""
    comm = SymmMemComm(group, device, timeout)
    error = None
    try:
        comm.reserve(1 << 20)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    ok = all_gather_ints(group, device, [int(error is None)])
    if all(row[0] for row in ok):
        return comm
    failed = [r for r, row in enumerate(ok) if not row[0]]
    return error or f"symmetric-memory rendezvous failed on group ranks {failed}"


_ALIGN = 512


class SymmMemComm(RingComm):
    """Pull transfers through one symmetric buffer per group (copy engines, not SMs).

    An exchange whose sends all go to one peer and whose receives all come from one peer (every
    ring exchange) runs on a high-priority side stream: copy the sends into this rank's buffer
    (in tag order), barrier, copy the matching slices of the source peer's buffer into the
    receive tensors, barrier. The first barrier publishes every rank's data, the second tells
    each rank its buffer has been read, so one buffer serves all exchanges. Any other batch, or
    one that needs a bigger buffer during CUDA-graph capture, goes through the group as given.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout: timedelta | None) -> None:
        super().__init__(group, transport="symm-mem", reason="copy-engine pulls from peer symmetric buffers")
        self.device = device
        self.timeout_ms = int((timeout or timedelta(minutes=10)).total_seconds() * 1000)
        self._buf: Tensor | None = None
        self._handle: Any = None
        self._views: dict[int, Tensor] = {}

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def reserve(self, nbytes: int) -> None:
        """Grow the symmetric buffer to at least ``nbytes`` (collective: all ranks at once, eager)."""
        if nbytes <= self.capacity:
            return
        import torch.distributed._symmetric_memory as symm_mem

        nbytes = -(-nbytes // (1 << 20)) * (1 << 20)
        stream = side_stream(self.device, priority=-1)
        if stream is not None:
            stream.synchronize()  # the old buffer is no longer read or written by this rank
        name = self.group.group_name
        enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        needed = enable is not None and not hasattr(enable, "__deprecated__")  # older torch only
        if needed and enabled is not None and not enabled(name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(name)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(buf, name)
        self._buf, self._handle = buf, handle
        self._views = {r: handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(self.size)}

    def start(self, ops: Sequence[P2P | dist.P2POp]) -> Pending:
        if not ops:
            return Pending()
        plan = self._plan(ops)
        if plan is None:
            return super().start(ops)
        sends, recvs, offsets, total, src = plan
        if total > self.capacity:
            if is_capturing():
                return super().start(ops)
            self.reserve(total)
        stream = side_stream(self.device, priority=-1)
        assert stream is not None and self._handle is not None
        current = torch.cuda.current_stream(self.device)
        wait_stream(stream, current)
        mine, theirs = self._buf, self._views[src]
        assert mine is not None
        with torch.cuda.stream(stream):
            for op, off in zip(sends, offsets, strict=True):
                _slice(mine, off, op.tensor).copy_(op.tensor)
            self._handle.barrier(channel=0, timeout_ms=self.timeout_ms)
            for op, off in zip(recvs, offsets, strict=True):
                op.tensor.copy_(_slice(theirs, off, op.tensor))
            self._handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        return Pending([], [op.tensor for op in ops], stream, current)

    def _plan(self, ops: Sequence[P2P | dist.P2POp]) -> tuple[list, list, list[int], int, int] | None:
        """Sends and receives in tag order with their buffer offsets and the source group rank,
        or None when the batch is not a one-peer-each-way exchange of matching tensors."""
        sends = sorted((op for op in ops if op.op is dist.isend), key=lambda op: op.tag)
        recvs = sorted((op for op in ops if op.op is not dist.isend), key=lambda op: op.tag)
        if not sends or len(sends) != len(recvs) or len({op.peer for op in sends}) != 1:
            return None
        if len({op.peer for op in recvs}) != 1:
            return None
        offsets, total = [], 0
        for s, r in zip(sends, recvs, strict=True):
            # Only facts that are the same on every rank decide, so all ranks take the same path.
            if s.tag != r.tag or s.tensor.shape != r.tensor.shape or s.tensor.dtype != r.tensor.dtype:
                return None
            offsets.append(total)
            total += -(-s.tensor.numel() * s.tensor.element_size() // _ALIGN) * _ALIGN
        src = self.global_ranks.index(recvs[0].peer)
        return sends, recvs, offsets, total, src


def _slice(buf: Tensor, offset: int, like: Tensor) -> Tensor:
    """The bytes of ``buf`` at ``offset`` viewed as a contiguous tensor shaped like ``like``."""
    nbytes = like.numel() * like.element_size()
    return buf[offset : offset + nbytes].view(like.dtype).view(like.shape)
