"""The benchmark scripts' own logic on CPU: tile names, the sweep's choice and merge, the ring's
window summary (the GPU timings themselves are in benchmarks/results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import tune_attention
from thd.ops.attention import launch

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "benchmarks" / "results" / "attention-tiles.json"


def test_tile_names_round_trip() -> None:
    tiles = [t for tiles in tune_attention.SWEEP.values() for t in tiles]
    tiles.append(launch.Tile(128, 64, 8, 3, tma=True, warp_specialize=True))
    for tile in tiles:
        assert tune_attention._tile_named(tile.name) == tile
    for bad in ("64x64", "64x64w4s3-ws-tma", "64x64w4s3 ", "axbw4s3"):
        with pytest.raises(ValueError, match="not a tile name"):
            tune_attention._tile_named(bad)


def _record(docs: str, dim: int, tiles: dict[str, dict[str, object]]) -> dict:
    return {"tokens": 16384, "docs": docs, "head_dim": dim, "pad_to": 1, "tiles": tiles}


def _ok(ms: float, correct: bool = True) -> dict[str, object]:
    return {"ms": ms, "max_rel_error": 0.0 if correct else 1.0, "correct": correct}


def test_best_tiles_least_total_time_over_correct_tiles() -> None:
    sweeps = [
        _record("64-1024", 128, {
            "fwd": {"64x64w4s3": _ok(1.0), "128x64w8s3": _ok(0.5, correct=False)},
            "dkdv-mode0": {"32x64w4s3": _ok(2.0)}, "dkdv-mode2": {"32x64w4s3": _ok(1.5)},
            "dq": {"128x64w8s3": _ok(2.0), "64x64w4s3": "OutOfResources: shared memory"},
        }),
        _record("256-4096", 128, {  # long: its own class
            "fwd": {"64x64w4s3": _ok(3.0), "64x64w4s3-tma": _ok(2.0)},
            "dkdv-mode0": {"32x64w4s3": _ok(4.0)}, "dkdv-mode2": {"32x64w4s3": _ok(4.5)},
            "dq": {"128x64w8s3": _ok(4.0)},
        }),
    ]  # fmt: skip
    tiles, mode = tune_attention.best_tiles(sweeps)
    # a wrong tile is never chosen even when fastest; a failed one neither
    assert tiles["fwd,128,short"] == launch._tile_entry(launch.Tile(64, 64, 4, 3))
    assert tiles["fwd,128,long"] == launch._tile_entry(launch.Tile(64, 64, 4, 3, tma=True))
    assert tiles["dq,128,short"] == launch._tile_entry(launch.Tile(128, 64, 8, 3))
    # mode 2 totals 1.5 + 4.5 = 6.0 against 2.0 + 4.0 for mode 0
    assert mode == 0
    assert tiles["dkdv,128,long"] == launch._tile_entry(launch.Tile(32, 64, 4, 3))


def test_merge_of_per_head_dim_sweeps_gives_the_committed_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    committed = json.loads(SWEEP.read_text())
    parts = []
    for dim in (128, 64):
        part = {k: committed[k] for k in ("command", "env", "host_us")}
        part["sweeps"] = [rec for rec in committed["sweeps"] if rec["head_dim"] == dim]
        parts.append(tmp_path / f"part{dim}.json")
        parts[-1].write_text(json.dumps(part))
    out, emitted = tmp_path / "merged.json", tmp_path / "tiles.json"
    argv = ["tune_attention", "--out", str(out), "--merge", *map(str, parts), "--emit-tiles", str(emitted)]
    monkeypatch.setattr(sys, "argv", argv)
    tune_attention.main()
    merged = json.loads(out.read_text())
    assert merged["best_tiles"] == committed["best_tiles"] == json.loads(emitted.read_text())
    assert (
        merged["best_dq_mode"] == committed["best_dq_mode"] == int((tmp_path / "tiles.json.mode").read_text())
    )
    assert len(merged["parts"]) == 2 and len(merged["sweeps"]) == len(committed["sweeps"])


def test_ring_window_summary_pairs_each_window_record_with_the_causal_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # bench_ring imports _common as a script
    import bench_ring

    shape = {
        "tokens_per_gpu": 32768,
        "kv_heads": 16,
        "heads": 16,
        "cp": 2,
        "mix": "1024-8192",
        "layout": "padded",
    }
    counts = {"calls": 4, "pairs": 20, "launches": 15, "skipped": 5}
    records = [
        {"provider": "single", "mode": "fwd", "shape": shape, "median_ms": 1.0, "tflops": 400.0},
        {"provider": "ring[auto]", "mode": "fwd", "shape": shape, "median_ms": 2.0, "tflops": 320.0},
        {"provider": "ring[nccl]", "mode": "fwd", "shape": shape, "median_ms": 9.0, "tflops": 300.0},
        {"provider": "ring_window4096[auto]", "mode": "fwd", "shape": {**shape, "window_left": 4096},
         "median_ms": 0.5, "tflops": 100.0, "window_left": 4096, "window_counts": counts,
         "skipped_share": 0.25},
        {"provider": "ring_window4096[auto]", "mode": "fwd_bwd", "shape": shape, "status": "error"},
    ]  # fmt: skip
    (row,) = bench_ring.window_summary(records)
    assert row["ring_ms"] == 2.0 and row["window_ring_ms"] == 0.5
    assert row["time_saved"] == pytest.approx(0.75)
    assert row["skipped_share"] == 0.25 and row["window_counts"] == counts
    # the efficiency summary leaves the windowed ring out (its FLOPs are not the causal ones)
    summary = bench_ring.summarize(records)
    assert [(r["provider"], r["cp_efficiency"]) for r in summary] == [
        ("ring[auto]", 0.8),
        ("ring[nccl]", 0.75),
    ]
