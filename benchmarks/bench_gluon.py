"""Forward attention TFLOP/s: the Gluon sm_90 kernel against the ``tl`` kernel (and FlashAttention-4
when ``flash_attn.cute`` imports), on the table rows of issue 24.

bf16, 16 heads, causal documents with uniform random lengths in a mix, packed or in slots rounded up
to a multiple of rows; TFLOP/s counted on real tokens; each provider's calls back to back between
one pair of CUDA events (``_common.bench_back_to_back``). ``--tiles64``/``--tiles128``/``--tiles256`` sweep
Gluon tiles (``BMxBNwWARPSsSTAGEScCONSUMERS[rREGSpCTAS]``). Every Gluon
output is checked against the ``tl`` output on real rows before it is timed. Writes one JSON
document (command, commit, GPU, versions, records) after every row.

    python benchmarks/bench_gluon.py --out benchmarks/results/gluon-fwd.json --commit SHA
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    attention_flops,
    bench_back_to_back,
    command_line,
    env_fingerprint,
    error_text,
    make_record,
    write_json,
)
from benchmarks.attention_providers import LayoutSpec, fa4_provider, make_problem, peer_versions
from thd.ops.attention import launch
from thd.ops.attention.gluon import forward as gluon_forward
from thd.ops.attention.params import AttentionOptions, ForwardCall, VarlenLayout

DEFAULT_TILES = dict(gluon_forward.TILES)
ROWS = (
    (128, "16384:64-1024"),
    (128, "16384:256-4096"),
    (128, "32768:512-8192"),
    (128, "32768:512-8192:128"),
    (64, "32768:512-8192"),
)


def _tile(text: str) -> gluon_forward.GluonTile:
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)c(\d)(?:r(\d+)p(\d))?", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"expected BMxBNwWARPSsSTAGEScCONSUMERS[rMAXNREGpCTAS], got {text!r}"
        )
    bm, bn, warps, stages, consumers, maxnreg, ctas = m.groups()
    three = consumers == "3"  # four warpgroups: FA3's 160 registers per consumer, 128 per thread overall
    return gluon_forward.GluonTile(
        int(bm), int(bn), int(warps), int(stages), int(consumers),
        maxnreg=int(maxnreg or (128 if three else 168)), ctas_per_sm=int(ctas or 1),
        consumer_regs=160 if three else 240,
    )  # fmt: skip


def measure(head_dim: int, spec: LayoutSpec, args: argparse.Namespace) -> list[dict[str, Any]]:
    p = make_problem(spec, 16, head_dim, seed=0, device="cuda")
    varlen = VarlenLayout(
        cu_seqlens_q=p.cu,
        cu_seqlens_kv=p.cu,
        cu_seqlens_q_padded=p.cu_slots if p.padded else None,
        cu_seqlens_kv_padded=p.cu_slots if p.padded else None,
        max_seqlen_q=p.max_len,
        max_seqlen_kv=p.max_len,
    )
    options = AttentionOptions(head_dim**-0.5, causal=True)
    flops = attention_flops(p.lengths, p.lengths, 16, head_dim, causal=True)
    shape = p.shape
    records = []
    tl_out = launch.forward(ForwardCall(p.q, p.k, p.v, varlen, options))[0]

    def timed(provider: str, fn, **extra: Any) -> None:  # type: ignore[no-untyped-def]
        try:
            timing = bench_back_to_back(fn, rep_ms=args.rep_ms)
        except Exception as exc:  # a provider that fails is a record, not an abort
            records.append(
                make_record(
                    op="attention",
                    provider=provider,
                    mode="fwd",
                    shape=shape,
                    status="error",
                    error=error_text(exc),
                    **extra,
                )
            )
            return
        records.append(
            make_record(
                op="attention",
                provider=provider,
                mode="fwd",
                shape=shape,
                flops=flops,
                timing=timing,
                **extra,
            )
        )
        print(
            f"{p.spec.text:24s} D{head_dim} {provider:6s} {extra.get('tile', ''):15s} "
            f"{records[-1]['tflops']:7.1f} TFLOP/s",
            flush=True,
        )

    timed("tl", lambda: launch.forward(ForwardCall(p.q, p.k, p.v, varlen, options)))
    default = DEFAULT_TILES[head_dim]
    for tile in getattr(args, f"tiles{head_dim}") or [default]:
        gluon_forward.TILES[head_dim] = tile
        try:
            out = gluon_forward.forward(ForwardCall(p.q, p.k, p.v, varlen, options))[0]
        except Exception as exc:  # a tile that does not compile (shared memory) is a record
            records.append(
                make_record(
                    op="attention", provider="gluon", mode="fwd", shape=shape, status="error",
                    error=error_text(exc), tile=tile.name,
                )
            )  # fmt: skip
            continue
        real = p.real_rows
        diff = (out[real].float() - tl_out[real].float()).abs().max().item()
        pad_ok = bool((out[~real] == 0).all().item())
        if not diff < 0.05 or not pad_ok:
            records.append(
                make_record(
                    op="attention",
                    provider="gluon",
                    mode="fwd",
                    shape=shape,
                    status="error",
                    error=f"max |gluon - tl| {diff:.3g}, padding zeros {pad_ok}",
                    tile=tile.name,
                )
            )
            print(
                f"{p.spec.text} D{head_dim} gluon {tile.name}: WRONG max diff {diff} pad {pad_ok}", flush=True
            )
            continue
        timed(
            "gluon",
            lambda: gluon_forward.forward(ForwardCall(p.q, p.k, p.v, varlen, options)),
            tile=tile.name,
            max_abs_diff_vs_tl=diff,
        )
        if args.sequence_major:
            _time_sequence_major(p, varlen, options, out, tile, timed)
    if args.fa4:
        try:
            fa4 = fa4_provider(p)
        except Exception as exc:
            records.append(
                make_record(
                    op="attention",
                    provider="fa4",
                    mode="fwd",
                    shape=shape,
                    status="unavailable",
                    error=error_text(exc),
                )
            )
        else:
            timed("fa4", lambda: fa4.call(p.q, p.k, p.v))
    return records


def _time_sequence_major(p, varlen, options, out, tile, timed) -> None:  # type: ignore[no-untyped-def]
    """The same tile over the work list in sequence-major order (``forward.SEQUENCE_MAJOR``),
    timed as ``gluon-sequence-major`` if its output is ``out`` bit for bit (the order moves work
    between programs, not the arithmetic)."""
    gluon_forward.SEQUENCE_MAJOR = True
    gluon_forward.PLANS.clear()
    try:
        again = gluon_forward.forward(ForwardCall(p.q, p.k, p.v, varlen, options))[0]
        if torch.equal(again, out):
            timed(
                "gluon-sequence-major",
                lambda: gluon_forward.forward(ForwardCall(p.q, p.k, p.v, varlen, options)),
                tile=tile.name,
            )
        else:
            print(f"{p.spec.text} {tile.name}: sequence-major output differs, not timed", flush=True)
    finally:
        gluon_forward.SEQUENCE_MAJOR = None
        gluon_forward.PLANS.clear()


def _ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each Gluon record's TFLOP/s and its ratio to every peer timed on the same shape."""
    ratios = []
    for rec in records:
        if rec["provider"] != "gluon" or rec["status"] != "ok":
            continue
        peers = {r["provider"]: r for r in records if r["shape"] == rec["shape"] and r["status"] == "ok"}
        ratios.append(
            {
                "label": f"D{rec['shape']['head_dim']}-{rec['shape']['tokens']}-{rec['shape']['mix']}"
                f"-slots{rec['shape']['slot_multiple']}",
                "tile": rec["tile"],
                "default_tile": rec["tile"] == DEFAULT_TILES[rec["shape"]["head_dim"]].name,
                "gluon_tflops": rec["tflops"],
                **{
                    f"vs_{name}": rec["tflops"] / peer["tflops"]
                    for name, peer in peers.items()
                    if name != "gluon"
                },
            }
        )
    return ratios


def _payload(args: argparse.Namespace, records: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> dict:
    return {
        "benchmark": "gluon-fwd",
        "command": command_line(),
        "commit": args.commit,
        "env": env_fingerprint(),
        "fa4_version": peer_versions()["fa4"] if args.fa4 else None,
        "config": {"heads": 16, "dtype": "bfloat16", "causal": True, "rep_ms": args.rep_ms},
        "records": records,
        "ratios": ratios,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gluon-fwd.json")
    parser.add_argument(
        "--commit", default="unknown", help="the thd commit measured (the GPU copy has no git)"
    )
    parser.add_argument(
        "--rows", nargs="*", default=None, help="D,TOKENS:MIX[:SLOT] (default: issue 24's table)"
    )
    for dim in (64, 128, 256):
        parser.add_argument(
            f"--tiles{dim}", nargs="*", type=_tile, default=None, help=f"Gluon tiles for head dim {dim}"
        )
    parser.add_argument("--fa4", action="store_true", help="time FlashAttention-4 as well")
    parser.add_argument(
        "--sequence-major", action="store_true",
        help="also time each tile over the work list in sequence-major order (forward.SEQUENCE_MAJOR)",
    )  # fmt: skip
    parser.add_argument("--rep-ms", type=float, default=200.0)
    args = parser.parse_args()
    rows = [(int(r.split(",")[0]), r.split(",")[1]) for r in args.rows] if args.rows else list(ROWS)
    records: list[dict[str, Any]] = []
    for head_dim, spec in rows:
        records += measure(head_dim, LayoutSpec.parse(spec), args)
        ratios = _ratios(records)
        write_json(args.out, _payload(args, records, ratios))  # after every row: a cut run keeps its rows
    for r in ratios:
        print(r, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
