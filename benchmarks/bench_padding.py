"""Benchmark: padding detection host cost and padding zeroing against ``masked_fill_``.

- Detection (``thd.padding.detect_pad_between_seqs``): host time of a cache hit (goal < 5 us)
  and of an eager miss (value comparison plus one small device-to-host copy), in microseconds
  from a ``perf_counter`` loop.
- Zeroing a ``--size-mib`` (default 64 MiB) bf16 ``[T, H, D]`` tensor with ``--pad-frac`` (5%)
  padding rows: ``thd.padding.zero_padding_`` (Triton kernel; detection by cache hit) against
  ``masked_fill_`` with a precomputed row mask, the capture-safe torch fallback (mask built on
  device, then ``masked_fill_``) and, for tail padding, the eager slicing fast path. Layouts:
  ``slots`` (padding spread over B slots) and ``tail`` (reserved capacity only). GPU times
  from ``triton.testing.do_bench`` in the same run; goal: ``masked_fill / thd >= 10``.

    python benchmarks/bench_padding.py --out benchmarks/results/padding.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _common import bench_ms, env_fingerprint, error_text, make_record, offsets_tensor, sync, write_json
from torch import Tensor

from thd.ops.zero_padding.reference import zero_padding_masked_
from thd.padding import (
    clear_detection_cache,
    detect_pad_between_seqs,
    detection_stats,
    valid_rows,
    zero_padding_,
)

HIT_GOAL_US = 5.0
SPEEDUP_GOAL = 10.0


def host_us(fn: Callable[[], object], *, calls: int, repeats: int = 7) -> dict[str, float]:
    """Median / min host microseconds per call over ``repeats`` loops of ``calls`` calls."""
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call), "calls": calls}


def _layout(lengths: Sequence[int], slots: Sequence[int], device: torch.device) -> tuple[Tensor, Tensor]:
    return offsets_tensor(lengths, device), offsets_tensor(slots, device)


def bench_detection(device: torch.device, num_seqs: int) -> dict[str, Any]:
    """Cache hit and eager miss host times for a layout of ``num_seqs`` sequences."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 4096) for _ in range(num_seqs)]
    slots = [-(-n // 8) * 8 for n in lengths]
    cu, cup = _layout(lengths, slots, device)
    same_cu, same_cup = _layout(lengths, lengths, device)  # value-equal, distinct objects
    result: dict[str, Any] = {"num_seqs": num_seqs}
    for cp_size in (1, 4):
        clear_detection_cache()
        detect_pad_between_seqs(cu, cup, cp_size=cp_size)
        detect_pad_between_seqs(same_cu, same_cup, cp_size=cp_size)
        hit = host_us(lambda cp_size=cp_size: detect_pad_between_seqs(cu, cup, cp_size=cp_size), calls=20_000)

        def miss(cp_size: int = cp_size) -> None:
            clear_detection_cache()
            detect_pad_between_seqs(same_cu, same_cup, cp_size=cp_size)

        sync(device)
        clear_cost = host_us(clear_detection_cache, calls=2_000)
        missed = host_us(miss, calls=500)
        missed["median_us"] -= clear_cost["median_us"]
        missed["min_us"] -= clear_cost["min_us"]
        result[f"cp{cp_size}"] = {
            "hit": hit,
            "miss": missed,
            "verdict_padded": detect_pad_between_seqs(cu, cup, cp_size=cp_size),
            "verdict_value_equal": detect_pad_between_seqs(same_cu, same_cup, cp_size=cp_size),
            "hit_goal_us": HIT_GOAL_US,
            "hit_goal_met": hit["median_us"] < HIT_GOAL_US,
        }
    clear_detection_cache()
    return result


def zeroing_case(
    kind: str, num_rows: int, pad_frac: float, num_seqs: int, device: torch.device
) -> tuple[Tensor, Tensor, int]:
    """(cu_seqlens, cu_seqlens_padded, valid_end) with ``pad_frac * num_rows`` padding rows."""
    pad_rows = round(num_rows * pad_frac)
    if kind == "tail":
        real = num_rows - pad_rows
        lengths = [real // num_seqs] * num_seqs
        lengths[-1] += real - sum(lengths)
        cu, cup = _layout(lengths, lengths, device)  # value-equal: only the tail is padding
        return cu, cup, real
    rng = random.Random(1)
    slot = num_rows // num_seqs
    cuts = sorted(rng.randint(0, pad_rows) for _ in range(num_seqs - 1))
    pads = [b - a for a, b in zip([0, *cuts], [*cuts, pad_rows], strict=True)]
    slots = [slot] * num_seqs
    slots[-1] += num_rows - sum(slots)
    lengths = [s - p for s, p in zip(slots, pads, strict=True)]
    cu, cup = _layout(lengths, slots, device)
    return cu, cup, num_rows


def bench_zeroing(
    args: argparse.Namespace, device: torch.device
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    heads, dim = args.heads, args.head_dim
    num_rows = args.size_mib * 2**20 // (2 * heads * dim)
    records: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    for kind in ("slots", "tail"):
        cu, cup, valid_end = zeroing_case(kind, num_rows, args.pad_frac, args.num_seqs, device)
        x = torch.randn(num_rows, heads, dim, device=device, dtype=torch.bfloat16)
        keep = valid_rows(cu, cup, num_rows)
        pad_mask = (~keep).view(-1, 1, 1)
        shape = {
            "layout": kind,
            "T": num_rows,
            "H": heads,
            "D": dim,
            "B": args.num_seqs,
            "dtype": "bfloat16",
            "mib": round(x.numel() * 2 / 2**20, 1),
            "pad_rows": int((~keep).sum()),
        }
        expected = x.masked_fill(pad_mask, 0)
        original = x.clone()
        providers: dict[str, Callable[[], object]] = {
            "thd": lambda x=x, cu=cu, cup=cup: zero_padding_(x, cu, cup),
            "masked_fill": lambda x=x, m=pad_mask: x.masked_fill_(m, 0),
            "torch_fallback": lambda x=x, cu=cu, cup=cup: zero_padding_masked_(x, cu, cup, True),
        }
        if kind == "tail":
            providers["thd_valid_end"] = lambda x=x, cu=cu, cup=cup, e=valid_end: zero_padding_(
                x, cu, cup, pad_between_seqs=False, valid_end=e
            )
        medians: dict[str, float] = {}
        for name, fn in providers.items():
            try:
                x.copy_(original)  # padding rows hold data again: a no-op provider would fail
                _check(name, kind, x, expected, fn)
                timing = bench_ms(fn, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                host = host_us(fn, calls=200, repeats=3)
                sync(device)
                medians[name] = timing["median_ms"]
                records.append(
                    make_record(
                        op="zero_padding",
                        provider=name,
                        mode="fwd",
                        shape=shape,
                        timing=timing,
                        host_us_per_call=host["median_us"],
                    )
                )
            except Exception as exc:  # a failing provider is recorded, the run goes on
                records.append(
                    make_record(
                        op="zero_padding",
                        provider=name,
                        mode="fwd",
                        shape=shape,
                        status="error",
                        error=error_text(exc),
                    )
                )
        row: dict[str, Any] = {"mode": "fwd", "shape": f"{kind} T={num_rows} H={heads} D={dim}"}
        if "thd" in medians and "masked_fill" in medians and medians["thd"] > 0:
            row["masked_fill/thd"] = medians["masked_fill"] / medians["thd"]
            row["goal"] = SPEEDUP_GOAL
            row["goal_met"] = row["masked_fill/thd"] >= SPEEDUP_GOAL
        if "thd" in medians and "torch_fallback" in medians and medians["thd"] > 0:
            row["torch_fallback/thd"] = medians["torch_fallback"] / medians["thd"]
        ratios.append(row)
    return records, ratios


def _check(name: str, kind: str, x: Tensor, expected: Tensor, fn: Callable[[], object]) -> None:
    """Run ``fn`` once on ``x`` (which it zeroes in place) and compare with the oracle."""
    fn()
    sync(x.device)
    if not torch.equal(x, expected):
        bad = int((x != expected).any(dim=(1, 2)).sum())
        raise AssertionError(f"{name} on {kind}: {bad} rows differ from masked_fill")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size in MiB (bf16)")
    parser.add_argument("--pad-frac", type=float, default=0.05, help="fraction of padding rows")
    parser.add_argument("--num-seqs", type=int, default=32, help="sequences in the layout")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=200.0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    payload: dict[str, Any] = {"benchmark": "padding", "env": env_fingerprint(), "config": vars(args)}
    try:
        payload["detection"] = bench_detection(device, num_seqs=64)
    except Exception as exc:
        payload["detection"] = {"status": "error", "error": error_text(exc)}
    payload["records"], payload["ratios"] = bench_zeroing(args, device)
    payload["detection_stats"] = detection_stats()
    write_json(args.out, payload)
    for row in payload["ratios"]:
        print(row)
    for key in ("cp1", "cp4"):
        det = payload["detection"].get(key, {})
        if det:
            print(
                f"detect {key}: hit {det['hit']['median_us']:.2f} us, miss {det['miss']['median_us']:.1f} us"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
