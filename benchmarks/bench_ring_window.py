"""The ring's window skipping, measured per rank on one GPU (issue 13).

With ``window_size=(W, 0)`` the ring runs one launch per (query half, key half) pair of each step
and, when it may read the lengths (``max_seqlen_*`` not given), skips every pair that no real
query's window reaches. Skipping saves compute only: every K/V block still travels round the
ring. This script measures that compute on a single GPU by running, for every rank ``r`` of a
``cp``-rank ring, the schedule rank ``r`` runs (its plan from :func:`thd.cp.plan.build_plan`,
the ring's own forward/backward loops and kernels) with the exchanges replaced by a loopback
that posts nothing (the received buffers are left as allocated: compute time does not depend
on their values, outputs are not checked here; the ring tests check them). Per rank and mode:

- ``causal``: the plain causal ring (no window), the baseline a windowed call would otherwise be;
- ``window_all_pairs``: the windowed schedule without skipping (the plan built as with
  ``max_seqlen_*`` given: only pairs ruled out whatever the lengths are skipped);
- ``window_skip``: the windowed schedule skipping the pairs no window reaches (the plan built
  after the ring's one host read of the lengths).

The ring's compute time is the slowest rank's; ``saved`` is ``1 - window_skip / window_all_pairs``
of that maximum (and of the sum over ranks). On several GPUs the exchanges overlap this compute,
so the wall-clock saving is at most this. Times: CUDA events, calls back to back
(:func:`_common.bench_back_to_back`); ``--device cpu`` is a smoke mode (torch reference kernels).

Example: ``python benchmarks/bench_ring_window.py --out ring-window.json --cp 2 4 8``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from _common import (
    attention_flops,
    bench_back_to_back,
    command_line,
    cuda_missing,
    document_lengths,
    env_fingerprint,
    error_text,
    make_record,
    offsets_tensor,
    write_json,
)
from torch import Tensor

MIXES: dict[str, tuple[int, int] | None] = {
    "1024-8192": (1024, 8192),
    "4096-32768": (4096, 32768),
    "one-document": None,
}
MODES = ("fwd", "fwd_bwd")
SCHEDULES = ("causal", "window_all_pairs", "window_skip")


@dataclass(frozen=True)
class RingLayout:
    """The global batch of one measurement: real lengths and slots (multiples of ``2 * cp``)."""

    cp: int
    lengths: tuple[int, ...]
    slots: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.slots)

    @property
    def padded(self) -> bool:
        return self.lengths != self.slots


def mix_lengths(total: int, mix: str, seed: int) -> list[int]:
    """:func:`_common.document_lengths` of ``mix``; ``one-document``: a single document of ``total``."""
    bounds = MIXES[mix]
    return [total] if bounds is None else document_lengths(total, *bounds, seed)


def make_layout(cp: int, tokens_per_rank: int, mix: str, seed: int) -> RingLayout:
    """``cp * tokens_per_rank`` tokens of ``mix``, each slot the length rounded up to ``2 * cp``."""
    lengths = mix_lengths(cp * tokens_per_rank, mix, seed)
    slots = [-(-n // (2 * cp)) * (2 * cp) for n in lengths]
    return RingLayout(cp, tuple(lengths), tuple(slots))


class LoopbackComm:
    """Stands in for :class:`thd.cp.comm.RingComm` in one process: rank ``rank`` of ``size``,
    whose exchanges post nothing (what a rank computes does not depend on what it receives)."""

    transport = "loopback"

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank

    def send(self, tensor: Tensor, offset: int, tag: int) -> Tensor:
        return tensor

    def recv(self, tensor: Tensor, offset: int, tag: int) -> Tensor:
        return tensor

    def start(self, ops: Sequence[Tensor]) -> LoopbackComm:
        return self

    def wait(self) -> None:
        """Nothing is outstanding."""


def rank_plan(layout: RingLayout, rank: int, schedule: str, window: int, scale: float, device: torch.device):  # type: ignore[no-untyped-def]
    """The :class:`thd.cp.plan.RingPlan` of ``rank`` for ``schedule`` (see the module docstring)."""
    from thd.cp.plan import PlanRequest, build_plan
    from thd.ops.attention.params import AttentionOptions, VarlenLayout

    cu = offsets_tensor(layout.lengths, device)
    cup = offsets_tensor(layout.slots, device)
    longest = max(layout.lengths)
    window_size = (-1, -1) if schedule == "causal" else (window, 0)
    slot = max(layout.slots) if layout.padded else None
    request = PlanRequest(
        VarlenLayout(cu, cu, cup, cup, longest, longest),
        AttentionOptions(scale, causal=True, window_size=window_size),
        cp_size=layout.cp,
        cp_rank=rank,
        pad_between_seqs=layout.padded,
        max_slot_q=slot,
        max_slot_kv=slot,
        read_layout=schedule == "window_skip",
    )
    return build_plan(request)


def rank_calls(
    plan: Any, rows: int, heads: int, dim: int, device: torch.device
) -> dict[str, Callable[[], object]]:
    """Forward and forward+backward of one rank's ring under ``plan`` (the ring's own loops)."""
    from thd.cp.ring import RingAttentionFunction, _forward

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(plan.cp_rank)
    q, k, v, do = (torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    comm = LoopbackComm(plan.cp_size, plan.cp_rank)

    def fwd() -> object:
        with torch.no_grad():
            return _forward(q, k, v, None, plan, comm, True)[0]  # type: ignore[arg-type]

    def fwd_bwd() -> object:
        out, _ = RingAttentionFunction.apply(qg, kg, vg, None, plan, comm, True)
        return torch.autograd.grad(out, (qg, kg, vg), do)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def measure_layout(layout: RingLayout, mix: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per (schedule, rank, mode)."""
    device = torch.device(args.device)
    heads, dim = args.heads, args.head_dim
    shape = {"cp": layout.cp, "tokens_per_rank": layout.rows // layout.cp, "mix": mix,
             "docs": len(layout.lengths), "max_doclen": max(layout.lengths), "heads": heads, "head_dim": dim,
             "window_left": args.window, "padding": layout.padded}  # fmt: skip
    records = []
    for schedule in SCHEDULES:
        window = None if schedule == "causal" else args.window
        flops = lambda mode, w=window: attention_flops(
            layout.lengths, layout.lengths, heads, dim, causal=True, mode=mode, window_left=w
        ) / layout.cp  # fmt: skip
        for rank in range(layout.cp):
            try:
                plan = rank_plan(layout, rank, schedule, args.window, dim**-0.5, device)
                calls = rank_calls(plan, layout.rows // layout.cp, heads, dim, device)
            except Exception as exc:  # recorded, never raised: the other schedules still run
                for mode in args.modes:
                    records.append(make_record(op="ring_rank", provider=schedule, mode=mode, shape=shape,
                                               status="error", error=error_text(exc), rank=rank))  # fmt: skip
                continue
            counts = {"launches": plan.launches, "pairs": plan.pairs, "skipped": plan.skipped}
            for mode in args.modes:
                try:
                    timing = bench_back_to_back(calls[mode], rep_ms=args.rep_ms, trials=args.trials)
                    records.append(make_record(op="ring_rank", provider=schedule, mode=mode, shape=shape,
                                               flops=flops(mode), timing=timing, rank=rank,
                                               **counts))  # fmt: skip
                except Exception as exc:
                    records.append(make_record(op="ring_rank", provider=schedule, mode=mode, shape=shape,
                                               status="error", error=error_text(exc), rank=rank))  # fmt: skip
    return records


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (cp, mix, mode): each schedule's slowest-rank and summed times, launches, and the
    share of the windowed schedule's compute that skipping saves."""
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        if "median_ms" not in r:
            continue
        key = (r["shape"]["cp"], r["shape"]["mix"], r["shape"]["tokens_per_rank"], r["mode"])
        groups.setdefault(key, {}).setdefault(r["provider"], []).append(r)
    out = []
    for (cp, mix, tokens, mode), by_schedule in groups.items():
        row: dict[str, Any] = {"cp": cp, "mix": mix, "tokens_per_rank": tokens, "mode": mode}
        for schedule, recs in by_schedule.items():
            complete = len(recs) == cp
            row[schedule] = {
                "max_rank_ms": max(r["median_ms"] for r in recs) if complete else None,
                "sum_ms": sum(r["median_ms"] for r in recs) if complete else None,
                "launches": sum(r["launches"] for r in recs),
                "skipped": sum(r["skipped"] for r in recs),
            }
        skip, full = row.get("window_skip"), row.get("window_all_pairs")
        if skip and full and skip["max_rank_ms"] and full["max_rank_ms"]:
            row["saved_max_rank"] = 1 - skip["max_rank_ms"] / full["max_rank_ms"]
            row["saved_sum"] = 1 - skip["sum_ms"] / full["sum_ms"]
            row["skipped_share"] = skip["skipped"] / (skip["launches"] + skip["skipped"])
        causal = row.get("causal")
        if skip and causal and skip["max_rank_ms"] and causal["max_rank_ms"]:
            row["window_skip_vs_causal"] = skip["max_rank_ms"] / causal["max_rank_ms"]
        out.append(row)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="ring sizes to emulate")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per rank")
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    parser.add_argument("--window", type=int, default=4096, help="window_size=(W, 0)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rep-ms", type=float, default=100.0, help="device time per measurement")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="", help="commit the code is at (the device copy has no .git)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke test")
    parser.add_argument("--quick", action="store_true", help="smoke run: cp 2, 8k tokens, short timings")
    args = parser.parse_args(argv)
    if args.quick:
        args.cp, args.tokens, args.rep_ms, args.trials = [2], 8192, 20.0, 3
    args.command = command_line(argv, "bench_ring_window.py")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if cuda_missing("bench_ring_window", args.device):
        return 1
    if args.device == "cpu":
        os.environ.setdefault("THD_ATTENTION_BACKEND", "reference")
    records: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"benchmark": "ring_window", "command": args.command, "commit": args.commit}
    for cp in args.cp:
        for mix in args.mixes:
            records.extend(measure_layout(make_layout(cp, args.tokens, mix, args.seed + cp), mix, args))
            payload.update(env=env_fingerprint(), config=vars(args), records=records)
            payload["summary"] = summarize(records)
            write_json(args.out, payload)  # after every layout: a cut-short run keeps its data
            print(f"done cp={cp} mix={mix}", file=sys.stderr, flush=True)
    for row in summarize(records):
        print(row, file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
