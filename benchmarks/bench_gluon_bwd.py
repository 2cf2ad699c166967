"""Benchmark: the Gluon sm_90 attention backward against the tl backward, same inputs, one run.

bf16, 16 heads, causal, packed documents of uniform random length in [512, 8192] (``--docs``) filling
32k tokens, head dims 128 and 64. One tl forward gives ``out`` / ``lse``; each backward (:data:`PROVIDERS`:
``thd.ops.attention.launch.backward``, and ``thd.ops.attention.gluon.backward.backward`` with its
defaults, with split dQ, with fp32 atomic dQ (two partitions: a TMA reduce-add per tile), and
with one consumer partition, split or atomic dQ, and split dQ with a three-stage dK/dV ring) is
then called back to back between one pair of CUDA events; each record also holds its relative
difference to the tl gradients (a provider that fails, e.g. a tile over the shared memory, is a
record with its error). ``--dkdv-tiles`` / ``--dq-tiles`` sweep tiles (``BMxBNsSTAGEScCONSUMERS[rREGS]``,
REGS the second consumer partition's registers): ``gluon-dkdv-<SPEC>`` is ``gluon`` with that dK/dV
tile at every head dim (``p`` after the spec: as persistent programs), ``gluon-dq-<SPEC>``
``gluon-split-dq`` with that dQ tile.
TFLOP/s count the backward as 2.5x the causal forward on real tokens.

    python benchmarks/bench_gluon_bwd.py --out benchmarks/results/gluon-bwd.json
    python benchmarks/bench_gluon_bwd.py --providers tl gluon --dkdv-tiles 64x128s3c2 --out sweep.json
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time
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
    error_text,
    make_record,
    write_json,
)

from thd.errors import ThdValueError
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


def _tile(text: str) -> gluon_backward.GluonTile:
    """``BMxBNsSTAGEScCONSUMERS[rREGS][q][p[hSECTION][d]]`` (e.g. ``64x128s2c2``, ``64x128s3c2r232``,
    ``128x128s2c2q``, ``128x128s2c2p``, ``128x128s2c2ph1d``; ``q``: dQ split by query rows between
    the two partitions (``GluonTile.dq_rows``); ``p``: the dK/dV kernel's persistent programs,
    ``hSECTION`` their heads per section of the work list, ``h0`` all heads, absent the tile's
    default; ``d`` their items from a global ticket): a tile either kernel can be specialized for
    (which of them compiles, and in how much shared memory, the run says)."""
    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)c(\d+)(?:r(\d+))?(q?)(p?)(?:h(\d+))?(d?)", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"expected BMxBNsSTAGEScCONSUMERS[rREGS][q][p[hSECTION][d]], e.g. 64x128s2c2, got {text!r}"
        )
    bm, bn, stages, consumers = (int(g) for g in m.groups()[:4])
    regs = int(m[5]) if m[5] else None
    problems = []
    if consumers not in (1, 2):
        problems.append("CONSUMERS is 1 or 2")
    if any(b < 64 or b & (b - 1) for b in (bm, bn)):
        problems.append("BM and BN are powers of two, at least 64")
    if stages < 1:
        problems.append("STAGES is at least 1")
    if regs is not None and consumers != 2:
        problems.append("rREGS is for two consumer partitions only")
    if regs is not None and (not 24 <= regs <= 256 or regs % 8):
        problems.append("REGS is a multiple of 8 in [24, 256]")
    if (m[8] or m[9]) and not m[7]:
        problems.append("hSECTION and d are for persistent programs (p) only")
    if problems:
        raise argparse.ArgumentTypeError(f"{text!r}: " + "; ".join(problems))
    try:  # the tile checks its own rules (dq_rows)
        return gluon_backward.GluonTile(
            bm,
            bn,
            consumers=consumers,
            num_stages=stages,
            consumer_regs=regs or 240,
            dq_rows=m[6] == "q",
            persistent=m[7] == "p",
            **({"head_section": int(m[8])} if m[8] else {}),
            dynamic=m[9] == "d",
        )
    except ThdValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _spec(tile: gluon_backward.GluonTile) -> str:
    """The tile as :func:`_tile` reads it (``rREGS`` only where not FA3's 240)."""
    regs = f"r{tile.consumer_regs}" if tile.consumer_regs != 240 else ""
    persistent = "p" if tile.persistent else ""
    if tile.persistent and tile.head_section != gluon_backward.GluonTile.head_section:
        persistent += f"h{tile.head_section}"
    if tile.persistent and tile.dynamic:
        persistent += "d"
    rows = "q" if tile.dq_rows else ""
    return f"{tile.block_m}x{tile.block_n}s{tile.num_stages}c{tile.consumers}{regs}{rows}{persistent}"


def _docs(text: str) -> tuple[int, int]:
    """``MIN-MAX`` document lengths."""
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if m is None or not 0 < int(m[1]) <= int(m[2]):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 0 < MIN <= MAX, e.g. 512-8192, got {text!r}")
    return int(m[1]), int(m[2])


def add_tile_providers(kernel: str, tiles: list[gluon_backward.GluonTile]) -> list[str]:
    """Add to :data:`PROVIDERS` one provider per tile: ``gluon-dkdv-<SPEC>`` (``gluon`` with that dK/dV
    tile at every head dim) or ``gluon-dq-<SPEC>`` (``gluon-split-dq`` with that dQ tile); their names."""
    names = []
    for tile in tiles:
        name = f"gluon-{kernel}-{_spec(tile)}"
        table = {key: tile if key[0] == kernel else t for key, t in gluon_backward.TILES.items()}
        PROVIDERS[name] = (None if kernel == "dkdv" else False, table)
        names.append(name)
    return names


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
    tokens: int,
    heads: int,
    dims: list[int],
    rep_ms: float,
    seed: int,
    providers: list[str],
    docs: tuple[int, int] = (512, 8192),
    budget_s: float | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """The records, and the ``D<dim> <provider>`` runs skipped once ``budget_s`` had passed."""
    started = time.monotonic()
    records, skipped = [], []
    lengths = document_lengths(tokens, *docs, seed)
    for dim in dims:
        q, k, v, do, layout = _inputs(lengths, heads, dim)
        shape = {
            "tokens": tokens,
            "docs": "-".join(map(str, docs)),
            "heads": heads,
            "head_dim": dim,
            "causal": True,
        }
        flops = attention_flops(lengths, lengths, heads, dim, causal=True, mode="bwd")
        options = AttentionOptions(dim**-0.5, causal=True)
        out, lse = launch.forward(ForwardCall(q, k, v, layout, options))
        call = BackwardCall(do, SavedForBackward(q, k, v, out, lse), layout, options)
        reference = launch.backward(call)
        for provider in providers:
            if budget_s is not None and time.monotonic() - started > budget_s:
                skipped.append(f"D{dim} {provider}")
                continue
            fn = functools.partial(_provider(provider), call)
            try:
                grads = fn()  # compiles a new specialization
            except Exception as exc:  # a tile that does not compile or launch is a record, not an abort
                error = error_text(exc)
                records.append(
                    make_record(
                        op="attention",
                        provider=provider,
                        mode="bwd",
                        shape=shape,
                        status="error",
                        error=error,
                    )
                )
                print(f"D{dim} {provider:18s} error: {error}", flush=True)
                continue
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
    return records, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--rep-ms", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--docs", type=_docs, default=(512, 8192), metavar="MIN-MAX", help="document lengths")
    tile_help = "adds gluon-{}-<SPEC> per BMxBNsSTAGEScCONSUMERS[rREGS] (e.g. 64x128s2c2, every head dim){}"
    parser.add_argument(
        "--dkdv-tiles", type=_tile, nargs="+", default=[], metavar="SPEC", help=tile_help.format("dkdv", "")
    )
    parser.add_argument(
        "--dq-tiles",
        type=_tile,
        nargs="+",
        default=[],
        metavar="SPEC",
        help=tile_help.format("dq", ", with split dQ"),
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="start no provider after this many seconds"
    )
    parser.add_argument("--out", default="benchmarks/results/gluon-bwd.json")
    args = parser.parse_args(argv)
    added = add_tile_providers("dkdv", args.dkdv_tiles) + add_tile_providers("dq", args.dq_tiles)
    providers = list(dict.fromkeys([*args.providers, *added]))
    records, skipped = run(
        args.tokens, args.heads, args.dims, args.rep_ms, args.seed, providers, args.docs, args.budget_s
    )
    ratios = {}
    timed = [r for r in records if r["status"] == "ok"]
    for r in timed:
        base = next((t for t in timed if t["provider"] == "tl" and t["shape"] == r["shape"]), None)
        if r["provider"] != "tl" and base is not None:
            ratios[f"D{r['shape']['head_dim']}-{r['provider']}"] = base["median_ms"] / r["median_ms"]
    payload = {
        "benchmark": "gluon_bwd",
        "command": command_line(),
        "code_commit": os.environ.get("THD_CODE_COMMIT", "unknown"),
        "env": env_fingerprint(),
        "config": {
            **vars(args),
            "providers": providers,
            "dkdv_tiles": [_spec(t) for t in args.dkdv_tiles],
            "dq_tiles": [_spec(t) for t in args.dq_tiles],
        },
        "records": records,
        "skipped_for_budget": skipped,
        "speedup_gluon_over_tl": ratios,
    }
    write_json(args.out, payload)
    print("speedup gluon/tl:", {k: round(v, 3) for k, v in ratios.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
