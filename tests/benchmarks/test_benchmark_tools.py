"""The benchmark scripts' own logic on CPU: tile names, the sweep's choice and merge, the ring's
window summary (the GPU timings themselves are in benchmarks/results)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import tune_attention
from thd._runtime import tiles as tile_policy

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "benchmarks" / "results" / "attention-tiles.json"


def test_tile_names_round_trip() -> None:
    tiles = [t for tiles in tune_attention.SWEEP.values() for t in tiles]
    tiles.append(tile_policy.Tile(128, 64, 8, 3, tma=True, warp_specialize=True))
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
    assert tiles["fwd,128,short"] == tile_policy.tile_entry(tile_policy.Tile(64, 64, 4, 3))
    assert tiles["fwd,128,long"] == tile_policy.tile_entry(tile_policy.Tile(64, 64, 4, 3, tma=True))
    assert tiles["dq,128,short"] == tile_policy.tile_entry(tile_policy.Tile(128, 64, 8, 3))
    # mode 2 totals 1.5 + 4.5 = 6.0 against 2.0 + 4.0 for mode 0
    assert mode == 0
    assert tiles["dkdv,128,long"] == tile_policy.tile_entry(tile_policy.Tile(32, 64, 4, 3))


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


def _needed_pairs(lengths: list[int], slots: list[int], cp: int, rank: int, window: int) -> int:
    """Brute force: (query chunk, key chunk) pairs of ``rank``'s causal windowed schedule in which
    some real query sees some real key (query i sees key j iff i - window <= j <= i)."""
    needed = 0
    for a in (rank, 2 * cp - 1 - rank):
        for c in range(a + 1):
            seen = False
            for length, slot in zip(lengths, slots, strict=True):
                size = slot // (2 * cp)
                queries = range(a * size, min((a + 1) * size, length))
                keys = range(c * size, min((c + 1) * size, length))
                seen = seen or any(i - window <= j <= i for i in queries for j in keys)
            needed += seen
    return needed


def test_ring_window_emulation_skips_exactly_the_pairs_no_window_reaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    import bench_ring_window

    out = tmp_path / "rw.json"
    argv = ["--device", "cpu", "--out", str(out), "--cp", "2", "4", "--tokens", "96", "--window", "20",
            "--heads", "1", "--head-dim", "8", "--rep-ms", "1", "--trials", "1",
            "--mixes", "1024-8192", "one-document"]  # fmt: skip
    assert bench_ring_window.main(argv) == 0
    payload = json.loads(out.read_text())
    records = payload["records"]
    assert all(r["status"] == "ok" for r in records)
    assert len(records) == 2 * 3 * (2 + 4) * 2  # mixes x schedules x ranks (cp 2 + cp 4) x modes
    for r in records:
        cp, mix = r["shape"]["cp"], r["shape"]["mix"]
        layout = bench_ring_window.make_layout(cp, 96, mix, 0 + cp)
        lengths, slots = list(layout.lengths), list(layout.slots)
        if r["provider"] == "causal":
            assert (r["launches"], r["skipped"]) == (cp, 0)
            continue
        assert r["launches"] + r["skipped"] == r["pairs"] == 2 * cp + 1
        if r["provider"] == "window_skip":
            assert r["launches"] == _needed_pairs(lengths, slots, cp, r["rank"], 20)
        else:
            assert r["launches"] == r["pairs"]
    skipping = [row for row in payload["summary"] if row["cp"] == 4 and row["mix"] == "one-document"]
    assert skipping and all(row["window_skip"]["skipped"] > 0 for row in skipping)
    for row in payload["summary"]:
        key = (row["cp"], row["mix"], row["mode"])
        ms = {schedule: [] for schedule in bench_ring_window.SCHEDULES}
        for r in records:
            if (r["shape"]["cp"], r["shape"]["mix"], r["mode"]) == key:
                ms[r["provider"]].append(r["median_ms"])
        skip, full = ms["window_skip"], ms["window_all_pairs"]
        assert row["saved_max_rank"] == pytest.approx(1 - max(skip) / max(full))
        assert row["saved_sum"] == pytest.approx(1 - sum(skip) / sum(full))


def test_attention_rounds_take_the_median_of_round_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_attention

    rounds = [
        {"median_ms": 3.0, "min_ms": 2.5, "max_ms": 3.5, "calls_per_trial": 10, "trials": 5},
        {"median_ms": 1.0, "min_ms": 0.9, "max_ms": 1.2, "calls_per_trial": 10, "trials": 5},
        {"median_ms": 2.0, "min_ms": 1.5, "max_ms": 4.0, "calls_per_trial": 10, "trials": 5},
    ]
    combined = bench_attention.combine_rounds(rounds)
    assert (combined["median_ms"], combined["min_ms"], combined["max_ms"]) == (2.0, 0.9, 4.0)
    assert combined["trials"] == 15 and combined["round_median_ms"] == [3.0, 1.0, 2.0]
    assert bench_attention.combine_rounds(rounds[:1]) == rounds[0]


def test_recorded_command_names_every_thd_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _common

    for name in [k for k in os.environ if k.startswith("THD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("THD_FWD_MAX_REGISTERS", "0")
    monkeypatch.setenv("THD_TILES", "my tiles.json")
    monkeypatch.setattr(sys, "argv", ["bench_ring_window.py", "--out", "r.json"])
    command = _common.command_line()
    assert command.startswith("THD_FWD_MAX_REGISTERS=0 THD_TILES='my tiles.json' ")
    assert command.endswith(" bench_ring_window.py --out r.json")
    assert _common.command_line(["--cp", "2"], "bench_ring.py") == "bench_ring.py --cp 2"
