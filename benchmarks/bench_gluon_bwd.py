"""Benchmark: the Gluon sm_90 attention backward against the tl backward, same inputs, one run.

bf16, 16 heads, causal, packed documents of uniform random length in [512, 8192] filling 32k
tokens, head dims 128 and 64. One tl forward gives ``out`` / ``lse``; each backward (:data:`PROVIDERS`:
``thd.ops.attention.launch.backward``, and ``thd.ops.attention.gluon.backward.backward`` with its
defaults, with split dQ, with fp32 atomic dQ (two partitions: a TMA reduce-add per tile), and
with one consumer partition, split or atomic dQ, and split dQ with a three-stage dK/dV ring) is
then called back to back between one pair of CUDA events; each record also holds its relative
difference to the tl gradients.
TFLOP/s count the backward as 2.5x the causal forward on real tokens.

    python benchmarks/bench_gluon_bwd.py --out benchmarks/results/gluon-bwd.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from _common import (
    attention_flops,
    bench_back_to_back,
    command_line,
    document_lengths,
    env_fingerprint,
    make_record,
    write_json,
)

from thd.ops.attention import launch
from thd.ops.attention.gluon import backward as gluon_backward
from thd.ops.attention.params import (
    AttentionOptions,
    BackwardCall,
    ForwardCall,
    SavedForBackward,
    VarlenLayout,
)


def _inputs(lengths: list[int], heads: int, dim: int) -> tuple[Any, ...]:
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    layout = VarlenLayout(cu, cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    q, k, v, do = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, do, layout


# provider -> (ATOMIC_DQ, tile table) of the Gluon backward (ATOMIC_DQ None: the default per head
# dim); None: the tl backward
PROVIDERS: dict[str, tuple[bool | None, dict] | None] = {
    "tl": None,
    "gluon": (None, dict(gluon_backward.TILES)),
    "gluon-split-dq": (False, dict(gluon_backward.TILES)),
    "gluon-atomic-dq": (True, dict(gluon_backward.TILES)),
    "gluon-1-consumer": (False, dict(gluon_backward.ONE_CONSUMER_TILES)),
    "gluon-atomic-dq-1-consumer": (True, dict(gluon_backward.ONE_CONSUMER_TILES)),
    "gluon-split-dq-3-stages": (
        False,
        {
            key: replace(tile, num_stages=3) if key[0] == "dkdv" else tile
            for key, tile in gluon_backward.TILES.items()
        },
    ),
}


def _provider(name: str) -> Callable[..., tuple]:
    setting = PROVIDERS[name]
    if setting is None:
        return launch.backward
    atomic, tiles = setting

    def call(typed_call: BackwardCall) -> tuple:
        gluon_backward.ATOMIC_DQ, gluon_backward.TILES = atomic, tiles
        return gluon_backward.backward(typed_call)

    return call


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(
    tokens: int, heads: int, dims: list[int], rep_ms: float, seed: int, providers: list[str]
) -> list[dict[str, Any]]:
    records = []
    lengths = document_lengths(tokens, 512, 8192, seed)
    for dim in dims:
        q, k, v, do, layout = _inputs(lengths, heads, dim)
        shape = {"tokens": tokens, "docs": "512-8192", "heads": heads, "head_dim": dim, "causal": True}
        flops = attention_flops(lengths, lengths, heads, dim, causal=True, mode="bwd")
        options = AttentionOptions(dim**-0.5, causal=True)
        out, lse = launch.forward(ForwardCall(q, k, v, layout, options))
        call = BackwardCall(do, SavedForBackward(q, k, v, out, lse), layout, options)
        reference = launch.backward(call)
        for provider in providers:
            fn = functools.partial(_provider(provider), call)
            grads = fn()
            diff = {
                name: _rel_diff(g, r)
                for name, g, r in zip(("dq", "dk", "dv"), grads, reference, strict=False)
            }
            timing = bench_back_to_back(fn, rep_ms=rep_ms)
            record = make_record(
                op="attention",
                provider=provider,
                mode="bwd",
                shape=shape,
                flops=flops,
                timing=timing,
                rel_diff_vs_tl=diff,
            )
            records.append(record)
            print(
                f"D{dim} {provider:18s} {timing['median_ms']:.3f} ms {record['tflops']:.0f} TFLOP/s "
                f"rel diff vs tl {max(diff.values()):.1e}",
                flush=True,
            )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--rep-ms", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--out", default="benchmarks/results/gluon-bwd.json")
    args = parser.parse_args(argv)
    records = run(args.tokens, args.heads, args.dims, args.rep_ms, args.seed, args.providers)
    ratios = {}
    for r in records:
        if r["provider"] != "tl":
            base = next(
                t
                for t in records
                if t["provider"] == "tl" and t["mode"] == r["mode"] and t["shape"] == r["shape"]
            )
            ratios[f"D{r['shape']['head_dim']}-{r['provider']}"] = base["median_ms"] / r["median_ms"]
    payload = {
        "benchmark": "gluon_bwd",
        "command": command_line(),
        "code_commit": os.environ.get("THD_CODE_COMMIT", "unknown"),
        "env": env_fingerprint(),
        "config": vars(args),
        "records": records,
        "speedup_gluon_over_tl": ratios,
    }
    write_json(args.out, payload)
    print("speedup gluon/tl:", {k: round(v, 3) for k, v in ratios.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
