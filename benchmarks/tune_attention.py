"""Tile sweep for the attention kernels: times every candidate tile of ``thd.ops.attention.launch``
per kernel on packed causal documents, and prints the table ``launch.TILES`` should hold.

Each kernel is timed alone (forward; dK/dV with atomic dQ; dK/dV + dQ kernel for the
deterministic backward), calls back to back between one pair of CUDA events, median of 3.

    PYTHONPATH=src:. python3 benchmarks/tune_attention.py --out tune.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from benchmarks._common import command_line, env_fingerprint
from thd.ops.attention import launch
from thd.ops.attention.params import AttentionOptions, VarlenLayout

MIXES = [(16384, 64, 1024), (16384, 256, 4096), (32768, 512, 8192)]


def _layout(tokens: int, lo: int, hi: int, pad_to: int, device: str) -> tuple[VarlenLayout, int, int]:
    rng = random.Random(tokens * 7 + lo)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(lo, hi), tokens - sum(lens)))
    slots = [-(-n // pad_to) * pad_to for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cup = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32, device=device)
    layout = VarlenLayout(
        cu, cu, cup if pad_to > 1 else None, cup if pad_to > 1 else None, max(lens), max(lens)
    )
    return layout, sum(slots), sum(n * n for n in lens)


def _time_ms(fn, calls: int = 10, trials: int = 3) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _with_tile(kernel: str, dim_class: int, tile: launch.Tile, fn):  # type: ignore[no-untyped-def]
    old = launch.TILES[(kernel, dim_class)]
    launch.TILES[(kernel, dim_class)] = tile
    try:
        return _time_ms(fn)
    except Exception as exc:  # a tile that does not compile or fit is recorded, not fatal
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        launch.TILES[(kernel, dim_class)] = old


def _sweep_kernel(kernel: str, cls: int, fn, flops: float) -> dict:  # type: ignore[no-untyped-def]
    results: dict = {}
    for tile in launch.CANDIDATES[kernel]:
        ms = _with_tile(kernel, cls, tile, fn)
        key = f"{tile.block_m}x{tile.block_n}w{tile.num_warps}s{tile.num_stages}"
        results[key] = ms if isinstance(ms, str) else {"ms": ms, "tflops": flops / ms / 1e9}
        print(kernel, cls, key, results[key], flush=True)
    return results


def _mix(tokens: int, lo: int, hi: int, head_dim: int, heads: int, pad_to: int) -> dict:
    layout, rows, sq = _layout(tokens, lo, hi, pad_to, "cuda")
    q, k, v, do = (torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    opts = AttentionOptions(head_dim**-0.5, causal=True)
    det = AttentionOptions(head_dim**-0.5, causal=True, deterministic=True)
    flops_fwd = 2 * heads * 2 * head_dim * sq / 2
    cls = max(64, head_dim)
    out, lse = launch.forward(q, k, v, layout, opts)
    calls = {
        "fwd": (lambda: launch.forward(q, k, v, layout, opts), flops_fwd),
        "dkdv": (lambda: launch.backward(do, q, k, v, out, lse, layout, opts), 2.5 * flops_fwd),
        "dq": (lambda: launch.backward(do, q, k, v, out, lse, layout, det), 2.5 * flops_fwd),
    }
    tiles = {kernel: _sweep_kernel(kernel, cls, fn, flops) for kernel, (fn, flops) in calls.items()}
    return {"tokens": tokens, "docs": f"{lo}-{hi}", "head_dim": head_dim, "pad_to": pad_to, "tiles": tiles}


def sweep(head_dim: int, heads: int, pad_to: int) -> list[dict]:
    return [_mix(tokens, lo, hi, head_dim, heads, pad_to) for tokens, lo, hi in MIXES]


def host_time_us() -> dict[str, float]:
    import thd

    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    q = torch.randn(128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kw = {"max_seqlen_q": 64, "max_seqlen_kv": 64, "causal": True}
    res = {}
    for name, fn in (
        ("fwd", lambda: thd.attention(q.detach(), q.detach(), q.detach(), cu, cu, **kw)),
        ("fwd_bwd", lambda: thd.attention(q, q, q, cu, cu, **kw).sum().backward()),
    ):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        res[name] = (time.perf_counter() - t) / 300 * 1e6
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--pad-to", default="1")
    args = parser.parse_args()
    payload = {"command": command_line(), "env": env_fingerprint(), "host_us": host_time_us(), "sweeps": []}
    print("host", payload["host_us"], flush=True)
    for head_dim in (int(x) for x in args.head_dims.split(",")):
        for pad_to in (int(x) for x in args.pad_to.split(",")):
            payload["sweeps"] += sweep(head_dim, 16, pad_to)
            with open(args.out, "w") as fh:
                json.dump(payload, fh, indent=1)
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
