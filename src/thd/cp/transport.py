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
  second barrier (:mod:`thd.cp.symm_mem`). Exchanges it cannot take (a buffer that would have
  to grow during CUDA-graph capture) go through the group as given.

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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from thd._capture import is_capturing
from thd.cp.comm import RingComm, all_gather_ints
from thd.cp.symm_mem import symm_mem_comm, unavailable_reason
from thd.errors import ThdValueError

__all__ = ["AUTO", "TRANSPORTS", "RankFacts", "clear_cache", "requested_transport", "ring_comm"]

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
    symm_error = unavailable_reason(device) if want == "symm-mem" else None
    mine = RankFacts(_CODES[want], _known_groups(), probe.bound, probe.high_priority, symm_error is None)
    facts = _gather_facts(group, device, mine)
    if any(f.wanted != facts[0].wanted for f in facts):
        got = {r: TRANSPORTS[f.wanted] for r, f in enumerate(facts)}
        why = f"ranks want different transports {got} (set {ENV} alike on every rank): the group as given"
        return _announce(RingComm(group, transport="nccl", reason=why), mode, warn=True), True
    if want == "nccl":
        why = f"{ENV}={mode}: the group as given"
        return _announce(RingComm(group, transport="nccl", reason=why), mode), True
    if want == "symm-mem":
        if all(f.symm_mem for f in facts):
            comm_or_error = symm_mem_comm(group, device, probe.timeout)
            if isinstance(comm_or_error, RingComm):
                return _announce(comm_or_error, mode), True
            symm_error = comm_or_error
        failed = [r for r, f in enumerate(facts) if not f.symm_mem]
        why = symm_error or f"symmetric memory unavailable on group ranks {failed}"
        log.info("thd.cp: symm-mem transport unavailable (%s); falling back to nccl-high-priority", why)
    if all(f.high_priority for f in facts):
        why = "the group already uses high-priority NCCL streams: as given"
        return _announce(RingComm(group, transport="nccl-high-priority", reason=why), mode), True
    comm = _derive(group, device, probe, facts)
    return _announce(comm, mode, warn=comm.transport == "nccl"), True


class RankFacts(NamedTuple):
    """What one member of a group tells the others before a transport is chosen (one row of
    the selection's ``all_gather``), so that every member takes the same branch."""

    wanted: int
    """Index in :data:`TRANSPORTS` of the transport this rank asks for (``auto`` resolved)."""
    known_groups: int
    """Process groups this rank has registered (a local-sync group name needs them equal)."""
    bound: bool
    """The default group is bound to a device (derive by ``split_group``)."""
    high_priority: bool
    """The group already runs high-priority NCCL streams."""
    symm_mem: bool
    """A local symmetric-memory allocation works (only asked for ``symm-mem``)."""


def _gather_facts(group: dist.ProcessGroup, device: torch.device, mine: RankFacts) -> list[RankFacts]:
    """Every member's :class:`RankFacts`, by group rank."""
    rows = all_gather_ints(group, device, [int(x) for x in mine])
    return [RankFacts(row[0], row[1], bool(row[2]), bool(row[3]), bool(row[4])) for row in rows]


def _high_priority_options() -> Any:
    cls = getattr(dist, "ProcessGroupNCCL", None)
    return None if cls is None else cls.Options(is_high_priority_stream=True)


def _derive(
    group: dist.ProcessGroup, device: torch.device, probe: _Probe, facts: list[RankFacts]
) -> RingComm:
    """A high-priority communicator with the members of ``group``, or ``group`` itself (logged)
    when it cannot be made the same way on every rank."""
    size = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    bound = all(f.bound for f in facts)
    split = bound and hasattr(dist, "split_group")
    if not split and any(f.bound for f in facts):
        reason = (
            "the default group is bound to a device (on some ranks only, or this torch has no "
            "split_group), where a new NCCL group would split the job's whole communicator: as given"
        )
        return RingComm(group, transport="nccl", reason=reason)
    if not split and any(f.known_groups != facts[0].known_groups for f in facts):
        reason = (
            "the ranks know different numbers of process groups "
            f"({[f.known_groups for f in facts]}), so a new group could not rendezvous: the group as given"
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
