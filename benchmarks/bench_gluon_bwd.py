"""Benchmark: the Gluon sm_90 attention backward against the tl backward, same inputs, one run.

bf16, 16 heads, causal, packed documents of uniform random length in [512, 8192] filling 32k
tokens, head dims 128 and 64. One tl forward gives ``out`` / ``lse``; each backward
(``thd.ops.attention.launch.backward`` and ``thd.ops.attention.gluon.backward.backward``, default
atomic dQ and deterministic) is then called back to back between one pair of CUDA events.
TFLOP/s count the backward as 2.5x the causal forward on real tokens.

    python benchmarks/bench_gluon_bwd.py --out benchmarks/results/gluon-bwd.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import torch
from _common import (
    attention_flops,
    bench_back_to_back,
    command_line,
    env_fingerprint,
    make_record,
    write_json,
)
from bench_attention import document_lengths

from thd.ops.attention import launch
from thd.ops.attention.gluon import backward as gluon_backward
from thd.ops.attention.params import AttentionOptions, VarlenLayout


def _inputs(lengths: list[int], heads: int, dim: int) -> tuple[Any, ...]:
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    layout = VarlenLayout(cu, cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    q, k, v, do = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, do, layout


def run(tokens: int, heads: int, dims: list[int], rep_ms: float, seed: int) -> list[dict[str, Any]]:
    records = []
    lengths = document_lengths(tokens, 512, 8192, seed)
    for dim in dims:
        q, k, v, do, layout = _inputs(lengths, heads, dim)
        shape = {"tokens": tokens, "docs": "512-8192", "heads": heads, "head_dim": dim, "causal": True}
        flops = attention_flops(lengths, lengths, heads, dim, causal=True, mode="bwd")
        for deterministic in (False, True):
            options = AttentionOptions(dim**-0.5, causal=True, deterministic=deterministic)
            out, lse = launch.forward(q, k, v, layout, options)
            backends = {"tl": launch.backward, "gluon": gluon_backward.backward}
            for provider, fn in backends.items():
                args = (do, q, k, v, out, lse, layout, options)
                timing = bench_back_to_back(functools.partial(fn, *args), rep_ms=rep_ms)
                mode = "bwd-deterministic" if deterministic else "bwd"
                records.append(
                    make_record(
                        op="attention", provider=provider, mode=mode, shape=shape, flops=flops, timing=timing
                    )
                )
                print(
                    f"D{dim} {mode:18s} {provider:6s} {timing['median_ms']:.3f} ms "
                    f"{records[-1]['tflops']:.0f} TFLOP/s",
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
    parser.add_argument("--out", default="benchmarks/results/gluon-bwd.json")
    args = parser.parse_args(argv)
    records = run(args.tokens, args.heads, args.dims, args.rep_ms, args.seed)
    ratios = {}
    for r in records:
        if r["provider"] == "gluon":
            base = next(
                t
                for t in records
                if t["provider"] == "tl" and t["mode"] == r["mode"] and t["shape"] == r["shape"]
            )
            ratios[f"D{r['shape']['head_dim']}-{r['mode']}"] = base["median_ms"] / r["median_ms"]
    payload = {
        "benchmark": "gluon_bwd",
        "command": command_line(),
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
