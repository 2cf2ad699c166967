"""Tile sweep for the attention kernels: times every tile of :data:`SWEEP` per kernel on packed
causal documents, and prints the table ``thd._runtime.tiles.TILES`` should hold.

Each kernel's tile is swept alone (forward; the backward with that dK/dV or dQ tile), calls back
to back between one pair of CUDA events, median of 3. Every tile's results are compared with
those of the table's tiles before the sweep (relative error, ``correct`` within bf16 tolerance);
wrong or failing tiles are never chosen.

    PYTHONPATH=src:. python3 benchmarks/tune_attention.py --out tune.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks._common import command_line, document_lengths, env_fingerprint
from thd._runtime import tiles as tile_policy
from thd.ops.attention import launch
from thd.ops.attention.params import (
    AttentionOptions,
    BackwardCall,
    ForwardCall,
    SavedForBackward,
    VarlenLayout,
)

MIXES = [(16384, 64, 1024), (16384, 256, 4096), (32768, 512, 8192)]
T = tile_policy.Tile
# Swept tiles per kernel: the table's tiles and their neighbours, pointer loads (cp.async) and
# tensor-descriptor (TMA) loads. Dropped after the 2011187 sweep (committed there): tiles that were
# never within 10% of the best on any mix, and the warp-specialized tile (slower on every mix; the
# Triton 3.9 compiler emits no warp_specialize op for these kernels on sm_90).
SWEEP: dict[str, list[tile_policy.Tile]] = {
    "fwd": [
        T(64, 64, 4, 3),
        T(64, 64, 4, 3, tma=True),
        T(64, 64, 4, 2, tma=True),
        T(128, 64, 4, 3),
        T(128, 64, 8, 3),
        T(128, 128, 8, 3),
        T(128, 128, 8, 3, tma=True),
        T(64, 128, 4, 2),
        T(64, 128, 4, 3),
        T(64, 128, 4, 2, tma=True),
        T(64, 128, 4, 3, tma=True),
        T(128, 64, 4, 3, tma=True),
    ],
    "dkdv": [
        T(32, 64, 4, 2),
        T(32, 64, 4, 3),
        T(32, 128, 4, 3),
        T(32, 64, 4, 3, tma=True),
        T(32, 128, 4, 3, tma=True),
        T(32, 128, 8, 3),
        T(32, 128, 8, 3, tma=True),
        T(64, 128, 8, 2),
        T(64, 128, 8, 3),
        T(64, 128, 8, 3, tma=True),
        # 16 query rows per step: the only dK/dV tile with dQ reductions (--dq-modes 2) that
        # ptxas compiles without spills at head_dim 128 (sm_90a, Triton 3.9)
        T(16, 64, 4, 3),
        T(16, 64, 4, 3, tma=True),
    ],
    "dq": [
        T(128, 64, 8, 3),
        T(64, 64, 4, 3),
        T(128, 64, 8, 3, tma=True),
        T(64, 64, 4, 3, tma=True),
        T(128, 128, 8, 3),
        T(64, 128, 4, 3),
        T(128, 32, 4, 3, tma=True),
    ],
}


def _layout(tokens: int, lo: int, hi: int, pad_to: int, device: str) -> tuple[VarlenLayout, int, int]:
    lens = document_lengths(tokens, lo, hi, seed=tokens * 7 + lo)
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


def _max_error(got: object, want: object) -> float:
    """Largest |difference| between two (tuples of) tensors relative to the largest |wanted| value of
    that tensor, NaN counted as infinite."""
    pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
    worst = 0.0
    for a, b in pairs:
        if a is None:
            continue
        a, b = a.float(), b.float()
        diff = torch.where(a == b, 0.0, (a - b).abs()).nan_to_num(nan=float("inf"))  # -inf == -inf
        scale = float(b.abs().nan_to_num(posinf=0.0).max().clamp_min(1e-6))
        worst = max(worst, float(diff.max()) / scale)
    return worst


def _with_tile(kernel: str, key: tuple[int, bool], tile: tile_policy.Tile, fn, want):  # type: ignore[no-untyped-def]
    old = tile_policy.TILES[(kernel, *key)]
    tile_policy.TILES[(kernel, *key)] = tile
    try:
        error = _max_error(fn(), want)
        return {"ms": _time_ms(fn), "max_rel_error": error, "correct": error <= _TOLERANCE}
    except Exception as exc:  # a tile that does not compile or fit is recorded, not fatal
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        tile_policy.TILES[(kernel, *key)] = old


# bf16 outputs and gradients: tiles differ in summation order only.
_TOLERANCE = 2e-2


def _sweep_kernel(kernel: str, key: tuple[int, bool], fn, flops: float, want) -> dict:  # type: ignore[no-untyped-def]
    results: dict = {}
    for tile in SWEEP[kernel]:
        res = _with_tile(kernel, key, tile, fn, want)
        if isinstance(res, dict):
            res["tflops"] = flops / res["ms"] / 1e9
        results[tile.name] = res
        print(kernel, key, tile.name, res, flush=True)
    return results


def _with_dq_mode(mode: int, fn):  # type: ignore[no-untyped-def]
    def call() -> object:
        old = tile_policy.FAST_DQ_MODE
        tile_policy.FAST_DQ_MODE = mode
        try:
            return fn()
        finally:
            tile_policy.FAST_DQ_MODE = old

    return call


def _mix(tokens: int, lo: int, hi: int, head_dim: int, heads: int, pad_to: int, modes: list[int]) -> dict:
    layout, rows, sq = _layout(tokens, lo, hi, pad_to, "cuda")
    q, k, v, do = (torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    opts = AttentionOptions(head_dim**-0.5, causal=True)
    det = AttentionOptions(head_dim**-0.5, causal=True, deterministic=True)
    flops_fwd = 2 * heads * 2 * head_dim * sq / 2
    key = (max(64, head_dim), hi > tile_policy.LONG_SEQUENCES)
    out, lse = launch.forward(ForwardCall(q, k, v, layout, opts))
    calls = {"fwd": (lambda: launch.forward(ForwardCall(q, k, v, layout, opts)), flops_fwd)}
    saved = SavedForBackward(q, k, v, out, lse)
    for mode in modes:
        options = det if mode == 0 else opts
        bwd = _with_dq_mode(mode, lambda o=options: launch.backward(BackwardCall(do, saved, layout, o)))
        calls[f"dkdv-mode{mode}"] = (bwd, 2.5 * flops_fwd)
    calls["dq"] = (lambda: launch.backward(BackwardCall(do, saved, layout, det)), 2.5 * flops_fwd)
    # The oracle for every tile: the results of the table's tiles before the sweep.
    wanted = {
        name: tuple(t.clone() if t is not None else None for t in fn()) for name, (fn, _) in calls.items()
    }
    tiles = {
        name: _sweep_kernel(name.split("-")[0], key, fn, flops, wanted[name])
        for name, (fn, flops) in calls.items()
    }
    return {"tokens": tokens, "docs": f"{lo}-{hi}", "head_dim": head_dim, "pad_to": pad_to, "tiles": tiles}


def _tile_named(name: str) -> tile_policy.Tile:
    """The tile whose :attr:`tile_policy.Tile.name` is ``name`` (e.g. ``64x128w4s3-tma``)."""
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(-tma)?(-ws)?", name)
    if match is None:
        raise ValueError(f"not a tile name: {name!r}")
    block_m, block_n, warps, stages = (int(x) for x in match.groups()[:4])
    return tile_policy.Tile(
        block_m, block_n, warps, stages, tma=bool(match[5]), warp_specialize=bool(match[6])
    )


def best_tiles(sweeps: list[dict]) -> tuple[dict[str, list[int]], int]:
    """Per (kernel, head-dim class, length class) the correct tile with the least total time over
    the mixes (tiles that failed or were wrong on any mix are out), and the dQ mode whose best tiles
    give the fastest backward overall."""
    totals: dict[tuple[str, str], dict[str, float]] = {}
    for rec in sweeps:
        length = "long" if int(rec["docs"].split("-")[1]) > tile_policy.LONG_SEQUENCES else "short"
        group = f"{max(64, rec['head_dim'])},{length}"
        for kernel, results in rec["tiles"].items():
            for name, res in results.items():
                slot = totals.setdefault((kernel, group), {})
                ok = isinstance(res, dict) and res.get("correct", True)
                slot[name] = slot.get(name, 0.0) + (res["ms"] if ok else float("inf"))
    totals = {key: {n: ms for n, ms in times.items() if ms != float("inf")} for key, times in totals.items()}
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
        kind = kernel.split("-")[0]
        tile = _tile_named(name)
        tiles[f"{kind},{group}"] = tile_policy.tile_entry(tile)
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
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="choose from these sweeps' results (e.g. one per GPU) instead",
    )
    args = parser.parse_args()
    if args.merge:
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        payload = {
            "command": command_line(),
            "parts": [{"command": p["command"], "env": p["env"]} for p in parts],
            "env": parts[0]["env"],
            "host_us": parts[0]["host_us"],
            "sweeps": [rec for p in parts for rec in p["sweeps"]],
        }
    else:
        payload = {
            "command": command_line(),
            "env": env_fingerprint(),
            "host_us": host_time_us(),
            "sweeps": [],
        }
        print("host", payload["host_us"], flush=True)
        modes = [int(x) for x in args.dq_modes.split(",")]
        for head_dim in (int(x) for x in args.head_dims.split(",")):
            for pad_to in (int(x) for x in args.pad_to.split(",")):
                for tokens, lo, hi in MIXES:  # written after each mix: a cut run keeps what it measured
                    payload["sweeps"].append(_mix(tokens, lo, hi, head_dim, 16, pad_to, modes))
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
