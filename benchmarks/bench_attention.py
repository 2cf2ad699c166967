"""Benchmark: packed causal documents, ``thd.attention`` against the attention users would pick.

The providers (thd per kernel family, FA4, cuDNN, varlen_attn, flex) are in
:mod:`attention_providers`, the timing in :mod:`attention_measure`, the summaries and README tables
in :mod:`attention_report`; ``plot_attention.py`` draws the figure from the JSON this writes.
TFLOP/s count real tokens only: ``2 * H * (D + Dv) * sum(visible pairs)`` forward with causal
pairs counted as ``L^2 / 2``, forward+backward 3.5x that. In the same run: the dense bf16 matmul
(8192^3) TFLOP/s, which every record is also reported as a fraction of, and the host time per
eager call on a tiny problem (2 documents of 64 tokens, 2 heads). ``--variants`` adds a left
window of 4096 (on the 32k/512-8192 documents and on one 32k document), softcap 50 and attention
sinks, thd against FA4. A provider that fails records its error; the run goes on.

    python benchmarks/bench_attention.py --out benchmarks/results/attention.json
    python benchmarks/bench_attention.py --quick --out /tmp/attention-smoke.json
    python benchmarks/bench_attention.py --table benchmarks/results/attention.json  # README tables
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import (
    MODE_FLOP_FACTORS,
    add_autograd_threads_argument,
    autograd_multithreading,
    autograd_threads,
    command_line,
    env_fingerprint,
    write_json,
)
from attention_measure import Settings, combine_rounds, dense_matmul, host_overhead, measure_problem
from attention_providers import (
    ONE_DOCUMENT,
    PROVIDERS,
    LayoutSpec,
    Variant,
    make_problem,
    peer_versions,
)
from attention_report import (
    GOALS,
    MODES,
    PADDED_GOAL,
    attention_records,
    host_summary,
    label,
    markdown_tables,
    padding_costs,
    print_summary,
    speedups,
)

__all__ = ["combine_rounds", "main", "parse_args"]

DEFAULT_LAYOUTS = (
    "16384:64-1024",
    "16384:256-4096",
    "32768:512-8192",
    "32768:512-8192:64",
    "32768:512-8192:128",
    "65536:25000-40000",
)
QUICK_LAYOUTS = ("4096:64-1024", "4096:64-1024:64")

FLOP_DEFINITION = (
    "real tokens only; forward = 2 * H * (D + Dv) * sum over documents of visible (query, key) pairs, "
    "causal pairs counted as L^2/2 (with a left window W: L^2/2 - (L-W)^2/2 when L > W); "
    f"fwd_bwd = {MODE_FLOP_FACTORS['fwd_bwd']}x forward; dense matmul = 2 * N^3"
)
TIMING_DEFINITION = (
    "per-call ms: calls issued back to back between one pair of CUDA events (no sync, no L2 flush in "
    "between), median over trials; fwd runs under no_grad, fwd_bwd is forward + torch.autograd.grad; "
    "with rounds > 1 the providers of a shape take turns, one timing each per round, and the median "
    "over rounds is reported"
)


VARIANT_NAMES = ("window", "softcap", "sinks")


def variant_problems(args: argparse.Namespace) -> list[tuple[Variant, LayoutSpec]]:
    tokens, window = args.variant_tokens, args.window
    docs = LayoutSpec(tokens, "512-8192")
    problems = [
        (Variant(f"window{window}", window_left=window), docs),
        (Variant(f"window{window}", window_left=window, one_document=True), docs),
        (Variant("softcap50", softcap=50.0), docs),
        (Variant("sinks", sinks=True), docs),
    ]
    return [(v, d) for v, d in problems if v.name.startswith(tuple(args.variant_names))]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run on the GPU machine with PYTHONPATH=src:. (FA4 on PYTHONPATH too, when installed).",
    )
    parser.add_argument("--out", help="JSON file to write (required unless --table)")
    parser.add_argument("--table", metavar="JSON", help="print the README tables of a result file and exit")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 4k tokens, head_dim 128, short timings"
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        type=LayoutSpec.parse,
        default=None,
        help=f"TOKENS:MIX[:SLOT] (default: {' '.join(DEFAULT_LAYOUTS)})",
    )
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, help="default: 128 64")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument(
        "--providers", nargs="+", choices=PROVIDERS, default=[p for p in PROVIDERS if p != "thd"],
        help="default: every one but thd (the family thd picks itself; thd-tl and thd-gluon force one)",
    )  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--variants", action="store_true", help="also window / softcap / sinks, thd vs FA4")
    parser.add_argument(
        "--variant-names", nargs="+", choices=VARIANT_NAMES, default=list(VARIANT_NAMES),
        help="with --variants: which of them (default: all)",
    )  # fmt: skip
    parser.add_argument("--variant-tokens", type=int, default=None, help="default 32768 (4096 with --quick)")
    parser.add_argument(
        "--window", type=int, default=None, help="left window (default 4096; 1024 with --quick)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rep-ms", type=float, default=None, help="device ms per measurement (default 100)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=1, help="time every provider once per round, taking turns; median"
    )
    parser.add_argument("--dense-n", type=int, default=None, help="dense matmul size (default 8192)")
    parser.add_argument("--host-calls", type=int, default=None, help="calls per host-time measurement (500)")
    parser.add_argument("--host-head-dim", type=int, default=128)
    parser.add_argument("--commit", default=None, help="the code's commit (default: git rev-parse HEAD)")
    add_autograd_threads_argument(parser)
    parser.add_argument(
        "--budget-s", type=float, default=None, help="stop starting new shapes after this many seconds (270)"
    )
    args = parser.parse_args(argv)
    if args.table is None and args.out is None:
        parser.error("--out is required (or --table JSON)")
    quick = args.quick
    defaults = {
        "layouts": [LayoutSpec.parse(t) for t in (QUICK_LAYOUTS if quick else DEFAULT_LAYOUTS)],
        "head_dims": [128] if quick else [128, 64],
        "variant_tokens": 4096 if quick else 32768,
        "window": 1024 if quick else 4096,
        "rep_ms": 20.0 if quick else 100.0,
        "dense_n": 4096 if quick else 8192,
        "host_calls": 50 if quick else 500,
        "budget_s": 120.0 if quick else 270.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if quick:
        args.trials = min(args.trials, 3)
    return args


def _work(args: argparse.Namespace) -> list[tuple[int, LayoutSpec, Variant]]:
    """(head_dim, layout, variant) of every shape to measure, in order."""
    work = [(d, spec, Variant()) for d in args.head_dims for spec in args.layouts]
    if args.variants:
        work += [(d, spec, variant) for variant, spec in variant_problems(args) for d in args.head_dims]
    return work


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(
        modes=tuple(args.modes), rep_ms=args.rep_ms, trials=args.trials, rounds=args.rounds,
        host_calls=args.host_calls, host_head_dim=args.host_head_dim, seed=args.seed,
    )  # fmt: skip


def _payload(args: argparse.Namespace, env: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    dense_tflops = next((r.get("tflops") for r in records if r.get("op") == "matmul"), None)
    if dense_tflops:
        for r in attention_records(records):
            r["fraction_of_dense"] = r["tflops"] / dense_tflops
    return {
        "benchmark": "attention",
        "command": command_line(),
        "commit": args.commit or env["git_sha"],
        "env": env,
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "table")},
            "layouts": [spec.text for spec in args.layouts],
        },
        "flop_definition": FLOP_DEFINITION,
        "timing_definition": TIMING_DEFINITION,
        "ratio_definition": "thd*/<peer> = peer median ms / thd median ms (= TFLOP/s ratio; > 1: thd faster)",
        "goals": {
            **{f"thd/{peer} {mode}": goal for (peer, mode), goal in GOALS.items()},
            "padded/packed": PADDED_GOAL,
            "host time": "thd wall_us <= varlen_attn wall_us",
        },
        "dense_matmul_tflops": dense_tflops,
        "records": records,
        "ratios": speedups(records),
        "padding": padding_costs(records),
        "host": host_summary(records),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table is not None:
        print(markdown_tables(json.loads(Path(args.table).read_text())))
        return 0
    with autograd_threads(args.autograd_threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = _settings(args)
    started = time.monotonic()
    env = {**env_fingerprint(), **peer_versions()}
    print(f"[bench_attention] dense matmul {args.dense_n}^3", file=sys.stderr, flush=True)
    records: list[dict[str, Any]] = [dense_matmul(args.dense_n, settings, device)]
    print("[bench_attention] host time per call", file=sys.stderr, flush=True)
    records += host_overhead(args.providers, settings, device)
    skipped: list[str] = []
    for head_dim, spec, variant in _work(args):
        if time.monotonic() - started > args.budget_s:
            where = ONE_DOCUMENT if variant.one_document else spec.text
            skipped.append(f"D{head_dim} {where} {variant.name}")
            continue
        seed = spec.seed(args.seed)
        p = make_problem(spec, args.heads, head_dim, seed, device, variant)
        print(f"[bench_attention] {label(p.shape)} ({len(p.lengths)} docs)", file=sys.stderr, flush=True)
        records += measure_problem(p, args.providers, settings)
        del p
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    payload = _payload(args, env, records)
    payload["skipped_for_budget"] = skipped
    payload["autograd_multithreading"] = autograd_multithreading()
    payload["wall_s"] = round(time.monotonic() - started, 1)
    write_json(args.out, payload)
    print_summary(payload)
    print(f"[bench_attention] wrote {args.out} in {payload['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
