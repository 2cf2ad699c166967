"""Where the Gluon forward's warps wait, from the kernel's own clock (``PROFILE``), on the GPU.

For each row (head dim, tokens, document mix): the plain kernel's TFLOP/s, the profiled kernel's
(the clock reads reorder a little), then per partition the share of its cycles spent in each place,
summed over all programs of ``--calls`` launches. Consumer columns: work item geometry, Q wait, K
wait (``k_full``), V wait (``v_full``), turn wait (ping-pong), S wait (``Q K^T`` wgmma), P V wait,
epilogue; the rest is softmax and issue. Producer: geometry, Q-buffer wait, copies (of which waits
for free stages). Writes one JSON document.

    python benchmarks/device/profile_gluon_waits.py --out gluon-waits.json --commit SHA
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its modules import _common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.*

from benchmarks._common import attention_flops, bench_back_to_back, env_fingerprint
from benchmarks.attention_providers import LayoutSpec, make_problem
from thd.ops.attention.gluon import forward as gluon_forward
from thd.ops.attention.params import AttentionOptions, ForwardCall, VarlenLayout

CONSUMER = ["total", "item", "q_wait", "k_wait", "v_wait", "turn_wait", "s_wait", "pv_wait", "epilogue"]
PRODUCER = ["total", "item", "q_buffer_wait", "copies", "stage_waits"]


def profile_row(head_dim: int, spec: str, calls: int, rep_ms: float) -> dict:
    p = make_problem(LayoutSpec.parse(spec), 16, head_dim, seed=0, device="cuda")
    varlen = VarlenLayout(
        cu_seqlens_q=p.cu, cu_seqlens_kv=p.cu, max_seqlen_q=max(p.lengths), max_seqlen_kv=max(p.lengths)
    )
    options = AttentionOptions(head_dim**-0.5, causal=True)
    call = ForwardCall(p.q, p.k, p.v, varlen, options)
    flops = attention_flops(p.lengths, p.lengths, 16, head_dim, causal=True)
    tile = gluon_forward.tile_for(head_dim, head_dim)
    plain = bench_back_to_back(lambda: gluon_forward.forward(call), rep_ms=rep_ms)
    buffer = torch.zeros(tile.consumers + 1, 16, dtype=torch.int64, device="cuda")
    gluon_forward.WAIT_PROFILE = buffer
    try:
        gluon_forward.forward(call)  # compile
        buffer.zero_()
        for _ in range(calls):
            gluon_forward.forward(call)
        torch.cuda.synchronize()
        counts = buffer.cpu().tolist()
        profiled = bench_back_to_back(lambda: gluon_forward.forward(call), rep_ms=rep_ms)
    finally:
        gluon_forward.WAIT_PROFILE = None
    record: dict = {
        "head_dim": head_dim, "layout": spec, "tile": tile.name, "calls": calls,
        "plain_tflops": flops / plain["median_ms"] / 1e9,
        "profiled_tflops": flops / profiled["median_ms"] / 1e9,
        "partitions": {},
    }  # fmt: skip
    for wg in range(tile.consumers):
        row = counts[wg]
        total = max(row[0], 1)
        shares = {name: round(row[i] / total, 4) for i, name in enumerate(CONSUMER) if i > 0}
        shares["rest"] = round(1 - sum(shares.values()), 4)
        counts_of = {"cycles": row[0], "tiles": row[9], "items": row[10]}
        record["partitions"][f"consumer{wg}"] = {**counts_of, **shares}
    row = counts[tile.consumers]
    total = max(row[0], 1)
    record["partitions"]["producer"] = {
        "cycles": row[0], "tiles": row[5], "items": row[6],
        **{name: round(row[i] / total, 4) for i, name in enumerate(PRODUCER) if i > 0},
    }  # fmt: skip
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument(
        "--rows",
        nargs="*",
        default=[
            "128,32768:512-8192",
            "128,16384:256-4096",
            "128,16384:64-1024",
            "64,32768:512-8192",
            "128,65536:25000-40000",
        ],
    )
    parser.add_argument("--calls", type=int, default=2, help="profiled launches per row")
    parser.add_argument("--rep-ms", type=float, default=40.0)
    args = parser.parse_args()
    records = []
    for row in args.rows:
        dim, spec = row.split(",", 1)
        record = profile_row(int(dim), spec, args.calls, args.rep_ms)
        records.append(record)
        print(json.dumps(record), flush=True)
    document = {
        "benchmark": "gluon forward wait profile",
        "command": " ".join(sys.argv),
        "commit": args.commit,
        "env": env_fingerprint(),
        "records": records,
    }
    args.out.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
