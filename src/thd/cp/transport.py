"""Which transport carries the ring's exchanges; the user passes only ``group``.

:func:`ring_comm` picks, once per process group (and cached for it):

- ``gloo`` (or whatever non-NCCL backend the group has) for CPU tensors: the group as given;
- ``nccl``: the group as given;
- ``nccl-high-priority``: a second NCCL communicator with the same members, created with
  high-priority CUDA streams, derived from the group on its first ring call. NCCL's transfer
  kernels then get SMs while the attention kernels fill the GPU; on a default-priority
  communicator they wait for the attention to drain. A group that already uses high-priority
  streams is used as given;
- ``symm-mem``: copy-engine transfers through ``torch.distributed._symmetric_memory``: the sender
  copies its tensors into a symmetric buffer, and after a barrier the receiver pulls them from
  the peer's buffer with ``copy_`` (a DMA, no SMs) on a high-priority side stream, followed by a
  second barrier. Exchanges it cannot take (a buffer that would have to grow during CUDA-graph
  capture) go through the group as given.

``THD_CP_TRANSPORT`` = ``auto`` (default: :data:`AUTO`) | ``nccl`` | ``nccl-high-priority`` |
``symm-mem`` overrides the choice. It must be the same on every rank; if the ranks disagree, they
all fall back to the group as given (logged). The choice is logged once per group on the
``thd.cp`` logger at INFO.

Collective rules (why derivation cannot deadlock):

- Derivation happens inside the first ring call on the group, which every member makes
  (``ring_attention`` is collective over its group). It starts with one small ``all_gather``
  over the user's group that compares what each rank wants and can do, so every rank takes the
  same branch: derive, or use the group as given. Only group members take part; other ranks of
  the job never need to call anything.
- With a bound default group (``init_process_group(..., device_id=...)``), the communicator is
  ``dist.split_group`` of the user's group: ``ncclCommSplit`` over that group's communicator
  only, ordered like every other collective of the group (torch 2.11 crashes in it when the
  process destroyed an earlier default NCCL group and created a new one, pytorch/pytorch#192109;
  ``THD_CP_TRANSPORT=nccl`` avoids it). Otherwise it is
  ``dist.new_group(ranks, use_local_synchronization=True)``: only members call it, and it does
  not advance the job-wide group counter, so the user's own later ``new_group`` calls keep their
  numbering. Its rendezvous name hashes the ranks and the number of groups the process knows;
  the ``all_gather`` checks that count is equal on all members and falls back otherwise.
- Never during CUDA-graph capture (creating a communicator is illegal there): a first call
  under capture uses the group as given for that call, logs it, and caches nothing.
- The first call with a group costs one small ``all_gather`` and one device-to-host read (and
  the communicator's creation); later calls cost one dict lookup.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from thd._capture import is_capturing
from thd.cp.comm import P2P, Pending, RingComm, _side_stream, _wait
from thd.errors import ThdValueError

__all__ = ["AUTO", "TRANSPORTS", "clear_cache", "requested_transport", "ring_comm"]

log = logging.getLogger("thd.cp")

TRANSPORTS = ("auto", "nccl", "nccl-high-priority", "symm-mem")
AUTO = "nccl-high-priority"
"""What ``auto`` resolves to on NCCL groups (the best transport measured on 2x H200, see
``benchmarks/results/README.md``)."""

ENV = "THD_CP_TRANSPORT"
_CODES = {name: i for i, name in enumerate(TRANSPORTS)}
_DESC = "thd_cp_high_priority"

# Test hooks: the CPU tests derive a gloo group through the same code (no NCCL on CPU).
_DERIVE_BACKEND = "nccl"


def requested_transport() -> str:
    """``THD_CP_TRANSPORT`` normalised (``auto`` when unset); :class:`ThdValueError` if unknown.

    Read on every call; each raw value is parsed once (a dict lookup after that)."""
    raw = os.environ.get(ENV, "")
    mode = _PARSED.get(raw)
    if mode is None:
        mode = raw.strip().lower().replace("_", "-") or "auto"
        if mode not in _CODES:
            raise ThdValueError(f"ring_attention: {ENV}={raw!r}: expected one of {', '.join(TRANSPORTS)}")
        if len(_PARSED) < 64:
            _PARSED[raw] = mode
    return mode


_PARSED: dict[str, str] = {}


@dataclass
class _Entry:
    group: dist.ProcessGroup  # strong reference: the id in the key cannot be reused while cached
    comm: RingComm


_CACHE: dict[tuple[int, str, str], _Entry] = {}
_CPU = torch.device("cpu")
_CAPTURE_LOGGED: set[int] = set()


def clear_cache() -> None:
    """Forget every cached transport (derived communicators stay alive in ``torch.distributed``)."""
    _CACHE.clear()
    _CAPTURE_LOGGED.clear()


def ring_comm(group: dist.ProcessGroup, like: Any) -> RingComm:
    """The :class:`RingComm` of ``group`` for tensors like ``like`` (chosen once and cached).

    Collective over ``group`` on the first call with it (see the module docstring); every member
    must make it, as every member calls ``ring_attention``.
    """
    device = like.device if isinstance(like, Tensor) else _CPU
    mode = requested_transport()
    key = (id(group), device.type, AUTO if mode == "auto" else mode)  # auto shares its target's entry
    entry = _CACHE.get(key)
    if entry is not None and entry.group is group:
        return entry.comm
    comm, cacheable = _select(group, device, mode)
    if cacheable:
        _CACHE[key] = _Entry(group, comm)
    return comm


# ----------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class _Probe:
    """What this rank knows about an NCCL group without communicating."""

    high_priority: bool
    timeout: timedelta | None
    bound: bool  # default group bound to a device (init_process_group(device_id=...)): split


def _nccl_backend(group: dist.ProcessGroup, device: torch.device) -> Any:
    """The group's NCCL backend for ``device`` (wrappers peeled), or None."""
    cls = getattr(dist, "ProcessGroupNCCL", None)
    if device.type != "cuda" or cls is None:
        return None
    try:
        backend = group._get_backend(device)
    except (RuntimeError, AttributeError, ValueError):
        return None
    wrapper = getattr(dist.distributed_c10d, "_ProcessGroupWrapper", None)
    while wrapper is not None and isinstance(backend, wrapper):
        backend = backend.wrapped_pg
    return backend if isinstance(backend, cls) else None


def _probe(group: dist.ProcessGroup, device: torch.device) -> _Probe | None:
    """None unless ``group`` runs NCCL on ``device``."""
    backend = _nccl_backend(group, device)
    if backend is None:
        return None
    options = getattr(backend, "options", None)
    high = bool(getattr(options, "is_high_priority_stream", False))
    timeout = getattr(options, "_timeout", None)
    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    return _Probe(high, timeout if isinstance(timeout, timedelta) else None, bound)


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "unknown"


def _known_groups() -> int:
    """How many process groups this process has registered (part of local-sync group names)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if names is not None else -1


def _select(group: dist.ProcessGroup, device: torch.device, mode: str) -> tuple[RingComm, bool]:
    """``(comm, cacheable)`` for ``group``; collective over the group when it is NCCL, eager, cp > 1."""
    if dist.get_world_size(group) == 1:
        return RingComm(group, transport="none", reason="one rank, no exchange"), True
    probe = _probe(group, device)
    if probe is None:
        name = _backend_name(group)
        comm = RingComm(group, transport=name, reason=f"{device.type} tensors on a {name} group")
        return _announce(comm, mode), True
    if is_capturing():
        comm = RingComm(
            group, transport="nccl",
            reason="first call under CUDA-graph capture, where no communicator can be created: "
            "the group as given, for this call (derivation retried on the next eager call)",
        )  # fmt: skip
        if id(group) not in _CAPTURE_LOGGED:
            _CAPTURE_LOGGED.add(id(group))
            _announce(comm, mode)
        return comm, False
    want = AUTO if mode == "auto" else mode
    symm_error = _symm_mem_unavailable(device) if want == "symm-mem" else None
    facts = [_CODES[want], _known_groups(), probe.bound, probe.high_priority, symm_error is None]
    rows = _all_gather_rows(group, device, [int(f) for f in facts])
    if any(row[0] != rows[0][0] for row in rows):
        got = {r: TRANSPORTS[row[0]] for r, row in enumerate(rows)}
        why = f"ranks want different transports {got} (set {ENV} alike on every rank): the group as given"
        return _announce(RingComm(group, transport="nccl", reason=why), mode, warn=True), True
    if want == "nccl":
        why = f"{ENV}={mode}: the group as given"
        return _announce(RingComm(group, transport="nccl", reason=why), mode), True
    if want == "symm-mem":
        if all(row[4] for row in rows):
            comm_or_error = _symm_mem_comm(group, device, probe, rows)
            if isinstance(comm_or_error, RingComm):
                return _announce(comm_or_error, mode), True
            symm_error = comm_or_error
        failed = [r for r, row in enumerate(rows) if not row[4]]
        why = symm_error or f"symmetric memory unavailable on group ranks {failed}"
        log.info("thd.cp: symm-mem transport unavailable (%s); falling back to nccl-high-priority", why)
    if all(row[3] for row in rows):
        why = "the group already uses high-priority NCCL streams: as given"
        return _announce(RingComm(group, transport="nccl-high-priority", reason=why), mode), True
    comm = _derive(group, device, probe, rows)
    return _announce(comm, mode, warn=comm.transport == "nccl"), True


def _all_gather_rows(group: dist.ProcessGroup, device: torch.device, facts: Sequence[int]) -> list[list[int]]:
    """Every member's ``facts`` (one small all_gather over ``group`` and one host read)."""
    mine = torch.tensor(list(facts), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).tolist()


def _high_priority_options() -> Any:
    cls = getattr(dist, "ProcessGroupNCCL", None)
    return None if cls is None else cls.Options(is_high_priority_stream=True)


def _derive(group: dist.ProcessGroup, device: torch.device, probe: _Probe, rows: list[list[int]]) -> RingComm:
    """A high-priority communicator with the members of ``group``, or ``group`` itself (logged)
    when it cannot be made the same way on every rank."""
    size = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    bound = all(row[2] for row in rows)
    split = bound and hasattr(dist, "split_group")
    if not split and any(row[2] for row in rows):
        reason = (
            "the default group is bound to a device (on some ranks only, or this torch has no "
            "split_group), where a new NCCL group would split the job's whole communicator: as given"
        )
        return RingComm(group, transport="nccl", reason=reason)
    if not split and any(row[1] != rows[0][1] for row in rows):
        reason = (
            "the ranks know different numbers of process groups "
            f"({[row[1] for row in rows]}), so a new group could not rendezvous: the group as given"
        )
        return RingComm(group, transport="nccl", reason=reason)
    try:
        if split:
            derived = dist.split_group(
                parent_pg=group, split_ranks=[list(range(size))], timeout=probe.timeout,
                pg_options=_high_priority_options(), group_desc=_DESC,
            )  # fmt: skip
            how = "dist.split_group of the group"
        else:
            nccl = _DERIVE_BACKEND == "nccl"
            index = (device.index if device.index is not None else torch.cuda.current_device()) if nccl else 0
            derived = dist.new_group(
                ranks=ranks, timeout=probe.timeout, backend=_DERIVE_BACKEND,
                pg_options=_high_priority_options() if nccl else None, use_local_synchronization=True,
                group_desc=_DESC, device_id=torch.device("cuda", index) if nccl else None,
            )  # fmt: skip
            how = "dist.new_group(use_local_synchronization=True) over the group's ranks"
    except Exception as exc:  # same arguments on every rank: a failure is a failure everywhere
        return RingComm(group, transport="nccl", reason=f"deriving a high-priority communicator failed "
                        f"({type(exc).__name__}: {exc}): the group as given")  # fmt: skip
    if derived is None or derived == dist.GroupMember.NON_GROUP_MEMBER:
        return RingComm(group, transport="nccl", reason="derivation returned no group: the group as given")
    return RingComm(group, derived, transport="nccl-high-priority",
                    reason=f"high-priority NCCL communicator derived once ({how})")  # fmt: skip


def _announce(comm: RingComm, mode: str, *, warn: bool = False) -> RingComm:
    """The one log line per chosen transport."""
    try:
        name = comm.group.group_name
    except (AttributeError, RuntimeError):
        name = "?"
    level = logging.WARNING if warn else logging.INFO
    log.log(level, "thd.cp: ring transport for group %s (%d ranks): %s -- %s [%s=%s]",
            name, comm.size, comm.transport, comm.reason, ENV, mode)  # fmt: skip
    return comm


# ----------------------------------------------------------------------------- symmetric memory


def _symm_mem_unavailable(device: torch.device) -> str | None:
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


def _symm_mem_comm(
    group: dist.ProcessGroup, device: torch.device, probe: _Probe, rows: list[list[int]]
) -> RingComm | str:
    """A :class:`SymmMemComm` with a first buffer rendezvoused on every rank, or why not."""
    del rows
    comm = SymmMemComm(group, device, probe.timeout)
    error = None
    try:
        comm.reserve(1 << 20)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    ok = _all_gather_rows(group, device, [int(error is None)])
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
        stream = _side_stream(self.device, priority=-1)
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
        stream = _side_stream(self.device, priority=-1)
        assert stream is not None and self._handle is not None
        current = torch.cuda.current_stream(self.device)
        _wait(stream, current)
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
        src = self._global.index(recvs[0].peer)
        return sends, recvs, offsets, total, src


def _slice(buf: Tensor, offset: int, like: Tensor) -> Tensor:
    """The bytes of ``buf`` at ``offset`` viewed as a contiguous tensor shaped like ``like``."""
    nbytes = like.numel() * like.element_size()
    return buf[offset : offset + nbytes].view(like.dtype).view(like.shape)
