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


def _with_tile(kernel: str, key: tuple[int, bool], tile: launch.Tile, fn):  # type: ignore[no-untyped-def]
    old = launch.TILES[(kernel, *key)]
    launch.TILES[(kernel, *key)] = tile
    try:
        return _time_ms(fn)
    except Exception as exc:  # a tile that does not compile or fit is recorded, not fatal
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        launch.TILES[(kernel, *key)] = old


def _sweep_kernel(kernel: str, key: tuple[int, bool], fn, flops: float) -> dict:  # type: ignore[no-untyped-def]
    results: dict = {}
    for tile in launch.CANDIDATES[kernel]:
        ms = _with_tile(kernel, key, tile, fn)
        name = f"{tile.block_m}x{tile.block_n}w{tile.num_warps}s{tile.num_stages}"
        results[name] = ms if isinstance(ms, str) else {"ms": ms, "tflops": flops / ms / 1e9}
        print(kernel, key, name, results[name], flush=True)
    return results


def _with_dq_mode(mode: int, fn):  # type: ignore[no-untyped-def]
    def call() -> object:
        old = launch.FAST_DQ_MODE
        launch.FAST_DQ_MODE = mode
        try:
            return fn()
        finally:
            launch.FAST_DQ_MODE = old

    return call


def _mix(tokens: int, lo: int, hi: int, head_dim: int, heads: int, pad_to: int, modes: list[int]) -> dict:
    layout, rows, sq = _layout(tokens, lo, hi, pad_to, "cuda")
    q, k, v, do = (torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    opts = AttentionOptions(head_dim**-0.5, causal=True)
    det = AttentionOptions(head_dim**-0.5, causal=True, deterministic=True)
    flops_fwd = 2 * heads * 2 * head_dim * sq / 2
    key = (max(64, head_dim), hi > launch.LONG_SEQUENCES)
    out, lse = launch.forward(q, k, v, layout, opts)
    calls = {"fwd": (lambda: launch.forward(q, k, v, layout, opts), flops_fwd)}
    for mode in modes:
        options = det if mode == 0 else opts
        bwd = _with_dq_mode(mode, lambda o=options: launch.backward(do, q, k, v, out, lse, layout, o))
        calls[f"dkdv-mode{mode}"] = (bwd, 2.5 * flops_fwd)
    calls["dq"] = (lambda: launch.backward(do, q, k, v, out, lse, layout, det), 2.5 * flops_fwd)
    tiles = {name: _sweep_kernel(name.split("-")[0], key, fn, flops) for name, (fn, flops) in calls.items()}
    return {"tokens": tokens, "docs": f"{lo}-{hi}", "head_dim": head_dim, "pad_to": pad_to, "tiles": tiles}


def sweep(head_dim: int, heads: int, pad_to: int, modes: list[int]) -> list[dict]:
    return [_mix(tokens, lo, hi, head_dim, heads, pad_to, modes) for tokens, lo, hi in MIXES]


def best_tiles(sweeps: list[dict]) -> tuple[dict[str, list[int]], int]:
    """Per (kernel, head-dim class, length class) the tile with the least total time over the mixes,
    and the dQ mode whose best tiles give the fastest backward overall."""
    totals: dict[tuple[str, str], dict[str, float]] = {}
    for rec in sweeps:
        length = "long" if int(rec["docs"].split("-")[1]) > launch.LONG_SEQUENCES else "short"
        group = f"{max(64, rec['head_dim'])},{length}"
        for kernel, results in rec["tiles"].items():
            for name, res in results.items():
                if isinstance(res, dict):
                    slot = totals.setdefault((kernel, group), {})
                    slot[name] = slot.get(name, 0.0) + res["ms"]
    best = {key: min(times, key=times.__getitem__) for key, times in totals.items() if times}
    mode_ms: dict[int, float] = {}
    for (kernel, group), name in best.items():
        if kernel.startswith("dkdv-mode"):
            mode = int(kernel.removeprefix("dkdv-mode"))
            mode_ms[mode] = mode_ms.get(mode, 0.0) + totals[(kernel, group)][name]
    mode = min(mode_ms, key=mode_ms.__getitem__) if mode_ms else 2
    tiles: dict[str, list[int]] = {}
    for (kernel, group), name in best.items():
        if kernel.startswith("dkdv-mode") and kernel != f"dkdv-mode{mode}":
            continue
        block_m, rest = name.split("x")
        block_n, rest = rest.split("w")
        warps, stages = rest.split("s")
        tiles[f"{kernel.split('-')[0]},{group}"] = [int(block_m), int(block_n), int(warps), int(stages)]
    return tiles, mode


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
    parser.add_argument("--emit-tiles", help="write the best tiles (THD_TILES format) and dQ mode here")
    parser.add_argument("--dq-modes", default="0,2", help="backward dQ modes to sweep (0: deterministic)")
    args = parser.parse_args()
    payload = {"command": command_line(), "env": env_fingerprint(), "host_us": host_time_us(), "sweeps": []}
    print("host", payload["host_us"], flush=True)
    for head_dim in (int(x) for x in args.head_dims.split(",")):
        for pad_to in (int(x) for x in args.pad_to.split(",")):
            modes = [int(x) for x in args.dq_modes.split(",")]
            payload["sweeps"] += sweep(head_dim, 16, pad_to, modes)
            with open(args.out, "w") as fh:
                json.dump(payload, fh, indent=1)
    tiles, mode = best_tiles(payload["sweeps"])
    payload["best_tiles"], payload["best_dq_mode"] = tiles, mode
    with open(args.out, "w") as fh:
        json.dump(payload, fh, indent=1)
    if args.emit_tiles:
        with open(args.emit_tiles, "w") as fh:
            json.dump(tiles, fh)
        with open(args.emit_tiles + ".mode", "w") as fh:
            fh.write(str(mode))
    print("best", tiles, "dq mode", mode, file=sys.stderr)


if __name__ == "__main__":
    main()
