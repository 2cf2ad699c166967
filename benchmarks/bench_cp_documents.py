"""Document-aware CP (issue 25) against today's uniform ring: bytes, planning time, balance.

Parts (``--parts``):

- ``bytes`` (host only): K/V bytes one attention layer exchanges per training step, summed over
  the ranks, counted from the plan as the ring sends them. A ring over ``R`` rows per rank sends,
  per rank, ``cp - 1`` K/V exchanges forward and ``cp - 1`` K/V plus ``cp - 1`` dK/dV exchanges
  backward (``thd.cp.ring``'s loops), each ``R * Hkv * (D + Dv) * bytes``. The uniform ring
  has ``R = sum(slots) / cp`` (every document, slots rounded up to ``2 * cp``); the
  document-aware plan ``R = plan.ring_rows`` (only its ring documents; 0 when it has none, then
  no ring call is made). Layer shape: Llama-3-8B (8 KV heads, head_dim 128, bf16).
- ``planning`` (host only): :func:`thd.cp.plan_documents` on 1M tokens of each mix (best and
  median wall time of ``--plan-reps`` calls, and the median process CPU time, which other
  processes on a shared host do not inflate), and :func:`thd.cp.document_layout` of rank 0 on
  ``--device`` (its piece table copied over and expanded into the buffer's row index there).
- ``balance`` (one device): every rank's work timed on its own, as
  ``benchmarks/bench_ring_window.py`` does: its local documents through :func:`thd.attention`,
  its ring region through the ring's own loops with loopback exchanges (compute only; the plan
  of the ring documents alone), and a linear-layer proxy (the rank's real tokens times a
  ``hidden x hidden`` weight: one matmul forward, three forward+backward). The planner balances
  the proxy's own cost (``CostModel(2 * hidden**2, 4 * heads * head_dim)``). Reported per (mix,
  cp, mode): each rank's ms, ``max / mean`` (goal <= 1.05) for the document-aware plan and
  for the uniform ring of the same batch (``--plans`` picks either).
- ``overlap`` (one device): per rank, :func:`thd.cp.document_attention` whole (on CUDA its
  local documents on a side stream beside the ring), the same call with ``overlap=False``
  (one after the other), and its two parts alone with the arguments it gives them
  (``thd.attention`` on the local region, ``thd.cp.ring_attention`` on the ring region), the
  ring's exchanges through the loopback of ``bench_ring_window.py`` (they post nothing, so on
  one GPU this measures the two parts' kernels running side by side, not hidden exchange
  time). ``efficiency = (local + ring) / whole`` summed over the ranks that have both parts
  (1: no overlap; 2: the shorter part entirely hidden) and ``serial_over_whole``.

Mixes, ``cp * tokens`` tokens each: ``1024-8192`` and ``64-1024`` (uniform lengths, the last one
cut), ``long-tail`` (half the tokens in documents drawn from 64k-256k tokens, each cut to what
is left of that half, the rest lognormal with median 1024 and sigma 1.2, capped at 32k). At 32k
tokens per rank half a batch is 32k tokens at cp 2 (so its long document is cut to 32k), 64k at
cp 4 and 128k at cp 8; each record gives the batch's ``longest`` document and how many are 64k
or longer (``long_documents``).

Example: ``python benchmarks/bench_cp_documents.py --out benchmarks/results/cp-documents.json
--parts bytes planning`` (CPU) and ``--parts balance overlap`` on the GPU; ``--quick --device
cpu`` is the smoke run. The timed parts write the JSON after every case, so a run cut by its
time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import bench_ring
import bench_ring_window
import torch
from _common import bench_back_to_back, command_line, env_fingerprint, error_text, make_record, write_json
from torch import Tensor

MIXES = ("1024-8192", "long-tail", "64-1024")
PARTS = ("bytes", "planning", "balance", "overlap")
PLANS = ("document", "uniform")
LONG = 65536  # the long-tail mix's long documents: 64k-256k tokens
MODES = ("fwd", "fwd_bwd")
# Llama-3-8B attention: what one K/V row weighs on the wire
KV_HEADS, HEAD_DIM, ELEMENT_BYTES = 8, 128, 2


def document_lengths(total: int, mix: str, seed: int) -> list[int]:
    """``total`` tokens of ``mix`` (see the module docstring), deterministic in ``seed``."""
    if mix != "long-tail":
        lo, hi = (int(x) for x in mix.split("-"))
        return bench_ring.document_lengths(total, lo, hi, seed)
    rng = random.Random(seed)
    lengths: list[int] = []
    long_budget = total // 2
    while long_budget > 0:
        n = min(rng.randint(LONG, 4 * LONG), long_budget)
        lengths.append(n)
        long_budget -= n
    rest = total - sum(lengths)
    while rest > 0:
        n = min(max(16, min(32768, int(rng.lognormvariate(math.log(1024), 1.2)))), rest)
        lengths.append(n)
        rest -= n
    rng.shuffle(lengths)
    return lengths


def _mix_facts(lengths: Sequence[int]) -> dict[str, int]:
    """What a batch holds: its longest document and how many are 64k tokens or longer."""
    return {"longest": max(lengths, default=0), "long_documents": sum(n >= LONG for n in lengths)}


def ring_bytes(rows_per_rank: int, cp: int, *, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> int:
    """Bytes one ring call sends over ``cp`` ranks forward + backward (see the module docstring)."""
    if cp == 1 or rows_per_rank == 0:
        return 0
    per_message = rows_per_rank * kv_heads * 2 * head_dim * ELEMENT_BYTES  # K and V (or dK and dV)
    return cp * 3 * (cp - 1) * per_message


def uniform_rows(lengths: Sequence[int], cp: int) -> int:
    return sum(-(-n // (2 * cp)) * (2 * cp) for n in lengths) // cp


def measure_bytes(args: argparse.Namespace) -> list[dict[str, Any]]:
    from thd.cp import plan_documents

    out = []
    for mix in args.mixes:
        for cp in args.cp:
            for seed in range(args.seeds):
                lengths = document_lengths(cp * args.tokens, mix, args.seed + 1000 * cp + seed)
                plan = plan_documents(lengths, cp)
                uniform = ring_bytes(uniform_rows(lengths, cp), cp)
                aware = ring_bytes(plan.ring_rows, cp)
                out.append({
                    "part": "bytes", "mix": mix, "cp": cp, "seed": seed, "docs": len(lengths),
                    "tokens_per_rank": args.tokens, "ring_documents": len(plan.ring_documents),
                    "ring_tokens": sum(lengths[d] for d in plan.ring_documents),
                    "uniform_bytes": uniform, "document_bytes": aware,
                    "reduction": (uniform / aware) if aware else None,
                    "cost_imbalance": plan.imbalance,
                    "buffer_rows": plan.rows, "buffer_overhead": plan.rows * cp / sum(lengths) - 1,
                    **_mix_facts(lengths),
                })  # fmt: skip
    return out


def measure_planning(args: argparse.Namespace) -> list[dict[str, Any]]:
    from thd.cp import document_layout, plan_documents

    out = []
    for mix in args.mixes:
        lengths = document_lengths(args.plan_tokens, mix, args.seed)
        for cp in args.cp:
            times, cpu_times, plan = [], [], None
            for _ in range(args.plan_reps):
                start, start_cpu = time.perf_counter(), time.process_time()
                plan = plan_documents(lengths, cp)
                cpu_times.append((time.process_time() - start_cpu) * 1e3)
                times.append((time.perf_counter() - start) * 1e3)
            assert plan is not None
            layout_ms = []
            device = torch.device(args.device)
            for _ in range(max(2, args.plan_reps // 10)):
                start = time.perf_counter()
                document_layout(plan, 0, device=device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                layout_ms.append((time.perf_counter() - start) * 1e3)
            out.append({
                "part": "planning", "mix": mix, "cp": cp, "tokens": sum(lengths), "docs": len(lengths),
                "plan_min_ms": min(times), "plan_median_ms": statistics.median(times), "reps": len(times),
                "plan_cpu_median_ms": statistics.median(cpu_times),
                "layout_rank0_median_ms": statistics.median(layout_ms),
                "ring_documents": len(plan.ring_documents), "cost_imbalance": plan.imbalance,
            })  # fmt: skip
    return out


def _rank_inputs(plan: Any, rank: int, heads: int, dim: int, device: torch.device) -> list[Tensor]:
    """Random ``q, k, v, dout`` of the rank's whole buffer (``[plan.rows, heads, dim]``)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(rank)
    return [torch.randn(plan.rows, heads, dim, device=device, dtype=dtype, generator=gen) for _ in range(4)]


def _local_attend(layout: Any) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``thd.attention`` on the local region, as :func:`thd.cp.document_attention` calls it."""
    import thd

    cu, longest = layout.local_cu_seqlens, layout.local_max_seqlen
    kw = {"cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu, "max_seqlen_q": longest,
          "max_seqlen_kv": longest, "causal": True}  # fmt: skip
    return lambda q, k, v: thd.attention(q, k, v, cu, cu, **kw)


def _local_calls(
    plan: Any, rank: int, heads: int, dim: int, device: torch.device
) -> dict[str, Callable[[], object]]:
    """This rank's local documents through ``thd.attention`` (forward, forward+backward)."""
    from thd.cp import document_layout

    layout = document_layout(plan, rank, device=device)
    if not layout.has_local:
        return {"fwd": lambda: None, "fwd_bwd": lambda: None}
    inputs = _rank_inputs(plan, rank, heads, dim, device)
    return bench_ring.mode_calls(_local_attend(layout), [t[plan.ring_rows :] for t in inputs])


def _ring_calls(lengths: Sequence[int], slots: Sequence[int], cp: int, rank: int, heads: int, dim: int,
                device: torch.device) -> dict[str, Callable[[], object]]:  # fmt: skip
    """The ring's own loops on rank ``rank``'s ring region (loopback exchanges)."""
    if not lengths:
        return {"fwd": lambda: None, "fwd_bwd": lambda: None}
    layout = bench_ring_window.RingLayout(cp, tuple(lengths), tuple(slots))
    plan = bench_ring_window.rank_plan(layout, rank, "causal", 0, dim**-0.5, device)
    return bench_ring_window.rank_calls(plan, layout.rows // cp, heads, dim, device)


def _linear_calls(tokens: int, hidden: int, device: torch.device) -> dict[str, Callable[[], object]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(7)
    x, dy = (torch.randn(max(tokens, 1), hidden, device=device, dtype=dtype, generator=gen) for _ in range(2))
    w = torch.randn(hidden, hidden, device=device, dtype=dtype, generator=gen) / hidden**0.5
    if tokens == 0:
        return {"fwd": lambda: None, "fwd_bwd": lambda: None}
    return {"fwd": lambda: x @ w, "fwd_bwd": lambda: (x @ w, dy @ w.t(), x.t() @ dy)}


def _time(fn: Callable[[], object], args: argparse.Namespace) -> float:
    return bench_back_to_back(fn, rep_ms=args.rep_ms, trials=args.trials, warmup_calls=args.warmup)[
        "median_ms"
    ]


def _rank_times(
    plan: Any, ring_lengths: list[int], args: argparse.Namespace, device: torch.device
) -> dict[str, list[dict[str, float]]]:
    """Per mode, each rank's ms of its local attention, ring region and linear proxy, and their sum.

    Every rank's calls are built first; then ``args.rounds`` rounds time every rank (each timing
    warms its call first), each round starting one rank later, and each part's time is its median
    over the rounds. A GPU's clock drifts over a case (it heats under the ring's long steps), so
    timing the ranks one after another once would read the drift as imbalance.
    """
    heads, dim, cp = args.heads, args.head_dim, plan.cp_size
    calls = [
        {
            "local": _local_calls(plan, rank, heads, dim, device),
            "ring": _ring_calls(ring_lengths, plan.ring_slots, cp, rank, heads, dim, device),
            "linear": _linear_calls(plan.rank_tokens[rank], args.hidden, device),
        }
        for rank in range(cp)
    ]
    samples: dict[tuple[str, int, str], list[float]] = {}
    for round_index in range(args.rounds):
        for step in range(cp):
            rank = (round_index + step) % cp
            for mode in args.modes:
                for part, by_mode in calls[rank].items():
                    samples.setdefault((mode, rank, part), []).append(_time(by_mode[mode], args))
    per_rank: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    for mode in args.modes:
        for rank in range(cp):
            parts = {part: statistics.median(samples[(mode, rank, part)]) for part in calls[rank]}
            parts["total"] = sum(parts.values())
            per_rank[mode].append(parts)
    return per_rank


def measure_balance(
    args: argparse.Namespace, checkpoint: Callable[[list[dict[str, Any]]], None] = lambda rows: None
) -> list[dict[str, Any]]:
    """Each rank's timed work per (mix, cp, plan); ``checkpoint(rows so far)`` after each case."""
    from thd.cp import CostModel, plan_documents

    device = torch.device(args.device)
    cost = CostModel(per_token=2.0 * args.hidden**2, per_pair=4.0 * args.heads * args.head_dim)
    out = []
    for mix in args.mixes:
        for cp in args.cp:
            lengths = document_lengths(cp * args.tokens, mix, args.seed + 1000 * cp)
            thresholds = {"document": None, "uniform": 0}  # uniform: every document rides the ring
            for name in args.plans:
                plan = plan_documents(lengths, cp, cost=cost, ring_threshold=thresholds[name])
                ring_lengths = [lengths[d] for d in plan.ring_documents]
                started = time.perf_counter()
                try:
                    per_rank = _rank_times(plan, ring_lengths, args, device)
                except Exception as exc:  # recorded, never raised: the other cases still run
                    out.append(make_record(op="cp_documents_balance", provider=name, mode="-", status="error",
                                           shape={"mix": mix, "cp": cp}, error=error_text(exc)))  # fmt: skip
                    continue
                for mode, ranks in per_rank.items():
                    totals = [r["total"] for r in ranks]
                    mean = statistics.fmean(totals)
                    out.append({
                        "part": "balance", "plan": name, "mix": mix, "cp": cp, "mode": mode,
                        "docs": len(lengths), "tokens_per_rank": args.tokens,
                        "ring_documents": len(plan.ring_documents),
                        "rank_ms": ranks, "max_ms": max(totals), "mean_ms": mean,
                        "max_over_mean": max(totals) / mean if mean > 0 else None,
                        "model_imbalance": plan.imbalance, "buffer_rows": plan.rows, **_mix_facts(lengths),
                        "case_s": time.perf_counter() - started,  # wall time of the case, both modes
                    })  # fmt: skip
                print(f"done balance {name} mix={mix} cp={cp}", file=sys.stderr, flush=True)
                checkpoint(out)
    return out


@contextmanager
def _loopback_ring(comm: list[Any]) -> Iterator[None]:
    """:func:`thd.cp.ring_attention` in one process, as ``bench_ring_window.py`` runs the ring:
    no process group, the exchanges through ``comm[0]`` (a ``LoopbackComm``: they post nothing)
    and no validation reads (with ``max_seqlen_*`` given on CUDA it makes none anyway)."""
    import thd.cp.ring as ring

    with (
        mock.patch.object(ring, "resolve_group", lambda fn, group: group),
        mock.patch.object(ring, "ring_comm", lambda group, like: comm[0]),
        mock.patch.object(ring, "_host_reads_allowed", lambda *args: False),
    ):
        yield


def _overlap_rank_times(
    plan: Any, rank: int, args: argparse.Namespace, device: torch.device
) -> dict[str, dict[str, Any]]:
    """Per mode, one rank's ms of ``document_attention`` whole with and without ``overlap`` and
    of its two parts alone, with the arguments it passes them (a rank without local or without
    ring documents runs one part only: nothing to overlap, not timed)."""
    from thd.cp import document_attention, document_layout, ring_attention

    layout = document_layout(plan, rank, device=device)
    both = layout.has_local and layout.has_ring
    facts = {"rank": rank, "timed": both, "local_documents": len(plan.local_documents[rank])}
    if not both:
        return {mode: dict(facts) for mode in args.modes}
    inputs = _rank_inputs(plan, rank, args.heads, args.head_dim, device)
    split = plan.ring_rows
    cu, cup, longest = layout.ring_cu_seqlens, layout.ring_cu_seqlens_padded, layout.ring_max_seqlen

    def ring(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ring_attention(q, k, v, cu, cu, cup, cup, pad_between_seqs=layout.ring_pad_between_seqs,
                              max_seqlen_q=longest, max_seqlen_kv=longest, causal=True)  # fmt: skip

    def whole(overlap: bool) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        return lambda q, k, v: document_attention(q, k, v, layout, causal=True, overlap=overlap)

    calls = {
        "whole": bench_ring.mode_calls(whole(True), inputs),
        "serial": bench_ring.mode_calls(whole(False), inputs),
        "local": bench_ring.mode_calls(_local_attend(layout), [t[split:] for t in inputs]),
        "ring": bench_ring.mode_calls(ring, [t[:split] for t in inputs]),
    }
    out = {}
    for mode in args.modes:
        entry: dict[str, Any] = {**facts, **{name: _time(c[mode], args) for name, c in calls.items()}}
        entry["efficiency"] = (entry["local"] + entry["ring"]) / entry["whole"]
        out[mode] = entry
    return out


def _overlap_row(
    mix: str, cp: int, mode: str, ranks: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """One (mix, cp, mode) case of the overlap part from its per-rank times."""
    timed = [r for r in ranks if r["timed"]]
    parts = sum(r["local"] + r["ring"] for r in timed)
    whole = sum(r["whole"] for r in timed)
    return {
        "part": "overlap", "mix": mix, "cp": cp, "mode": mode, "tokens_per_rank": args.tokens,
        "rank_ms": ranks, "ranks_timed": len(timed),
        "efficiency": parts / whole if whole > 0 else None,
        "serial_over_whole": sum(r["serial"] for r in timed) / whole if whole > 0 else None,
        "min_rank_efficiency": min((r["efficiency"] for r in timed), default=None),
        "slowest_parts_ms": max((r["local"] + r["ring"] for r in timed), default=None),
        "slowest_whole_ms": max((r["whole"] for r in timed), default=None),
    }  # fmt: skip


def measure_overlap(
    args: argparse.Namespace, checkpoint: Callable[[list[dict[str, Any]]], None] = lambda rows: None
) -> list[dict[str, Any]]:
    """Per (mix, cp, mode), each rank's ``document_attention`` (its local documents on a side
    stream beside the ring) against its parts alone; ``efficiency = (local + ring) / whole``
    summed over the ranks that have both (1: no overlap; 2: the shorter part fully hidden)."""
    from thd.cp import CostModel, plan_documents

    device = torch.device(args.device)
    cost = CostModel(per_token=2.0 * args.hidden**2, per_pair=4.0 * args.heads * args.head_dim)
    out: list[dict[str, Any]] = []
    comm: list[Any] = [None]
    for mix in args.mixes:
        for cp in args.cp:
            lengths = document_lengths(cp * args.tokens, mix, args.seed + 1000 * cp)
            plan = plan_documents(lengths, cp, cost=cost)
            ranks: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
            started = time.perf_counter()
            try:
                with _loopback_ring(comm):
                    for rank in range(cp):
                        comm[0] = bench_ring_window.LoopbackComm(cp, rank)
                        for mode, entry in _overlap_rank_times(plan, rank, args, device).items():
                            ranks[mode].append(entry)
            except Exception as exc:  # recorded, never raised: the other cases still run
                out.append(make_record(op="cp_documents_overlap", provider="document", mode="-",
                                       status="error", shape={"mix": mix, "cp": cp},
                                       error=error_text(exc)))  # fmt: skip
                checkpoint(out)
                continue
            for mode, per_rank in ranks.items():
                row = _overlap_row(mix, cp, mode, per_rank, args)
                row.update(docs=len(lengths), ring_documents=len(plan.ring_documents), **_mix_facts(lengths),
                           case_s=time.perf_counter() - started)  # fmt: skip
                out.append(row)
            print(f"done overlap mix={mix} cp={cp}", file=sys.stderr, flush=True)
            checkpoint(out)
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    byte_rows = [r for r in rows if r.get("part") == "bytes"]
    if byte_rows:
        table = {}
        for r in byte_rows:
            key = f"{r['mix']} cp={r['cp']}"
            entry = table.setdefault(key, {"uniform_bytes": 0, "document_bytes": 0, "max_cost_imbalance": 0.0,
                                           "ring_documents": 0, "batches": 0})  # fmt: skip
            entry["uniform_bytes"] += r["uniform_bytes"]
            entry["document_bytes"] += r["document_bytes"]
            entry["ring_documents"] += r["ring_documents"]
            entry["batches"] += 1
            entry["max_cost_imbalance"] = max(entry["max_cost_imbalance"], r["cost_imbalance"])
        for entry in table.values():
            entry["reduction"] = (
                entry["uniform_bytes"] / entry["document_bytes"] if entry["document_bytes"] else None
            )
        summary["bytes"] = table
    plan_rows = [r for r in rows if r.get("part") == "planning"]
    if plan_rows:
        summary["planning_max_median_ms"] = max(r["plan_median_ms"] for r in plan_rows)
    bal = [r for r in rows if r.get("part") == "balance"]
    if bal:
        summary["balance"] = {
            f"{r['plan']} {r['mix']} cp={r['cp']} {r['mode']}": r["max_over_mean"] for r in bal
        }
    over = [r for r in rows if r.get("part") == "overlap"]
    if over:
        summary["overlap"] = {
            f"{r['mix']} cp={r['cp']} {r['mode']}": {"efficiency": r["efficiency"],
                                                   "serial_over_whole": r["serial_over_whole"]}
            for r in over
        }  # fmt: skip
    errors = [r for r in rows if r.get("status") == "error"]
    if errors:
        summary["errors"] = [f"{r['op']} {r['shape']}: {r['error']}" for r in errors]
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=None,
                        help="default: bytes and planning, and balance and overlap on a GPU")  # fmt: skip
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per rank")
    parser.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    parser.add_argument("--seeds", type=int, default=5, help="batches per (mix, cp) for the byte counts")
    parser.add_argument("--plan-tokens", type=int, default=1 << 20)
    parser.add_argument("--plan-reps", type=int, default=50)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--hidden", type=int, default=4096, help="linear proxy: [tokens, hidden] x [hidden, hidden]"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS),
                        help="balance: the document-aware plan and/or the uniform ring")  # fmt: skip
    parser.add_argument("--rep-ms", type=float, default=40.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="calls before each timing")
    parser.add_argument("--rounds", type=int, default=3,
                        help="balance: rounds over the ranks, rotated; median per part")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="", help="commit the code is at (the device copy has no .git)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny sizes, short timings (cp 2 and 4)"
    )
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # smaller defaults; flags still win
        parser.set_defaults(tokens=512, seeds=1, plan_tokens=1 << 16, plan_reps=3, heads=2, head_dim=16,
                            hidden=64, rep_ms=1.0, trials=1, warmup=0, rounds=2, cp=[2, 4])  # fmt: skip
    args = parser.parse_args(argv)
    if args.parts is None:
        args.parts = ["bytes", "planning"] + (["balance", "overlap"] if args.device == "cuda" else [])
    args.command = command_line(argv, "bench_cp_documents.py")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cp_documents: --device cuda needs a GPU (or --device cpu)", file=sys.stderr)
        return 1
    if args.device == "cpu":
        import os

        os.environ.setdefault("THD_ATTENTION_BACKEND", "reference")
    payload: dict[str, Any] = {"benchmark": "cp_documents", "command": args.command, "commit": args.commit}
    rows: list[dict[str, Any]] = []

    def save(more: list[dict[str, Any]]) -> None:  # a cut-short run keeps what it measured
        payload.update(
            env=env_fingerprint(), config=vars(args), records=rows + more, summary=summarize(rows + more)
        )
        write_json(args.out, payload)

    for part, fn in (("bytes", measure_bytes), ("planning", measure_planning)):
        if part in args.parts:
            rows.extend(fn(args))
            save([])
    for part, timed in (("balance", measure_balance), ("overlap", measure_overlap)):
        if part in args.parts:
            rows.extend(timed(args, checkpoint=save))
            save([])
    for key, value in summarize(rows).items():
        print(key, value, file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
