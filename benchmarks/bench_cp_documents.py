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
  for the uniform ring of the same batch.

Mixes, ``cp * tokens`` tokens each: ``1024-8192`` and ``64-1024`` (uniform lengths, the last one
cut), ``long-tail`` (half the tokens in documents of 64k-256k tokens, each capped by what is
left of that half, the rest lognormal with median 1024 and sigma 1.2, capped at 32k).

Example: ``python benchmarks/bench_cp_documents.py --out benchmarks/results/cp-documents.json
--parts bytes planning`` (CPU) and ``--parts balance`` on the GPU; ``--quick --device cpu``
is the smoke run.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import bench_ring
import bench_ring_window
import torch
from _common import bench_back_to_back, command_line, env_fingerprint, error_text, make_record, write_json

MIXES = ("1024-8192", "long-tail", "64-1024")
PARTS = ("bytes", "planning", "balance")
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
        n = min(rng.randint(65536, 262144), long_budget)
        lengths.append(n)
        long_budget -= n
    rest = total - sum(lengths)
    while rest > 0:
        n = min(max(16, min(32768, int(rng.lognormvariate(math.log(1024), 1.2)))), rest)
        lengths.append(n)
        rest -= n
    rng.shuffle(lengths)
    return lengths


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


def _local_calls(
    plan: Any, rank: int, heads: int, dim: int, device: torch.device
) -> dict[str, Callable[[], object]]:
    """This rank's local documents through ``thd.attention`` (forward, forward+backward)."""
    import thd
    from thd.cp import document_layout

    layout = document_layout(plan, rank, device=device)
    rows = plan.rows - plan.ring_rows
    if not layout.has_local:
        return {"fwd": lambda: None, "fwd_bwd": lambda: None}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(rank)
    q, k, v, do = (torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    cu, longest = layout.local_cu_seqlens, layout.local_max_seqlen
    kw = {"cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu, "max_seqlen_q": longest,
          "max_seqlen_kv": longest, "causal": True}  # fmt: skip

    def fwd() -> object:
        with torch.no_grad():
            return thd.attention(q, k, v, cu, cu, **kw)

    def fwd_bwd() -> object:
        out = thd.attention(qg, kg, vg, cu, cu, **kw)
        return torch.autograd.grad(out, (qg, kg, vg), do)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


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
    """Per mode, each rank's ms of its local attention, ring region and linear proxy, and their sum."""
    per_rank: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    heads, dim, cp = args.heads, args.head_dim, plan.cp_size
    for rank in range(cp):
        calls = {
            "local": _local_calls(plan, rank, heads, dim, device),
            "ring": _ring_calls(ring_lengths, plan.ring_slots, cp, rank, heads, dim, device),
            "linear": _linear_calls(plan.rank_tokens[rank], args.hidden, device),
        }
        for mode in args.modes:
            parts = {part: _time(c[mode], args) for part, c in calls.items()}
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
            plans = {"document": plan_documents(lengths, cp, cost=cost),
                     "uniform": plan_documents(lengths, cp, cost=cost, ring_threshold=0)}  # fmt: skip
            for name, plan in plans.items():
                ring_lengths = [lengths[d] for d in plan.ring_documents]
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
                        "model_imbalance": plan.imbalance, "buffer_rows": plan.rows,
                    })  # fmt: skip
                print(f"done balance {name} mix={mix} cp={cp}", file=sys.stderr, flush=True)
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
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=None,
                        help="default: bytes and planning, and balance when a GPU is visible")  # fmt: skip
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
    parser.add_argument("--rep-ms", type=float, default=40.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="calls before each timing")
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
                            hidden=64, rep_ms=1.0, trials=1, warmup=0, cp=[2, 4])  # fmt: skip
    args = parser.parse_args(argv)
    if args.parts is None:
        args.parts = ["bytes", "planning"] + (["balance"] if args.device == "cuda" else [])
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
    if "balance" in args.parts:
        rows.extend(measure_balance(args, checkpoint=save))
        save([])
    for key, value in summarize(rows).items():
        print(key, value, file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
