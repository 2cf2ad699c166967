"""The benchmark scripts' own logic on CPU: tile names, the sweep's choice and merge, the ring's
window summary (the GPU timings themselves are in benchmarks/results)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("threads", ["on", "off"])
def test_attention_benchmark_measures_under_the_autograd_threads_asked_for(
    threads: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--autograd-threads``: every measurement (the dense matmul, host times, each problem's
    providers) runs with autograd's multithreading as asked, and the JSON says which."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_attention

    seen: list[bool] = []

    def no_records(*_: object) -> list:
        seen.append(torch.autograd.is_multithreading_enabled())
        return []

    monkeypatch.setattr(bench_attention, "dense_matmul", lambda *a: {"op": "matmul", "none": no_records()})
    monkeypatch.setattr(bench_attention, "host_overhead", no_records)
    monkeypatch.setattr(bench_attention, "measure_problem", no_records)
    out = tmp_path / "bench.json"
    argv = ["--quick", "--layouts", "2048:64-1024", "--providers", "thd", "--out", str(out)]
    assert bench_attention.main([*argv, "--autograd-threads", threads]) == 0
    assert len(seen) >= 3 and set(seen) == {threads == "on"}
    assert json.loads(out.read_text())["autograd_multithreading"] is (threads == "on")
    assert torch.autograd.is_multithreading_enabled()  # restored after the run


def test_variant_names_pick_the_variant_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_attention

    def names(*argv: str) -> list[tuple[str, bool]]:
        args = bench_attention.parse_args(["--out", "x.json", "--variants", *argv])
        return [(v.name, v.one_document) for v, _ in bench_attention.variant_problems(args)]

    every = names()
    assert every == [("window4096", False), ("window4096", True), ("softcap50", False), ("sinks", False)]
    assert names("--variant-names", "softcap") == [("softcap50", False)]
    assert names("--variant-names", "sinks", "window") == [e for e in every if e[0] != "softcap50"]


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


# ----------------------------------------------------------------------------- attention benchmark


def _attention_modules(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The split attention benchmark, imported as its scripts import one another."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import attention_measure
    import attention_providers
    import attention_report

    return attention_providers, attention_measure, attention_report


def test_document_lengths_fill_the_total_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _common

    for total, lo, hi, seed in ((16384, 64, 1024, 0), (1000, 256, 4096, 3), (5, 1, 2, 1)):
        lengths = _common.document_lengths(total, lo, hi, seed)
        assert sum(lengths) == total and all(1 <= n <= hi for n in lengths)
        assert all(n >= lo for n in lengths[:-1])  # only the last one is cut
        assert lengths == _common.document_lengths(total, lo, hi, seed)
    assert _common.offsets([3, 0, 5]) == [0, 3, 3, 8]
    assert _common.offsets_tensor([3, 5], "cpu").tolist() == [0, 3, 8]


def _attention_record(
    provider: str, mode: str, ms: float, shape: dict | None = None, **extra: object
) -> dict:
    shape = shape or {"tokens": 16384, "heads": 16, "head_dim": 128, "mix": "64-1024", "slot_multiple": 1}
    return {"op": "attention", "provider": provider, "mode": mode, "shape": shape, "status": "ok",
            "median_ms": ms, "tflops": 100.0 / ms, **extra}  # fmt: skip


def test_attention_speedups_per_kernel_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thd provider (each kernel family, and an old file's plain ``thd``) against every peer;
    goals only where the issue set one (none for cuDNN)."""
    _, _, report = _attention_modules(monkeypatch)
    records = [
        _attention_record("thd-tl", "fwd", 2.0),
        _attention_record("thd-gluon", "fwd", 1.0),
        _attention_record("fa4", "fwd", 1.5),
        _attention_record("cudnn", "fwd", 3.0),
        {"op": "attention", "provider": "varlen_attn", "mode": "fwd", "shape": {}, "status": "error"},
    ]
    (row,) = report.speedups(records)
    assert row["thd-tl/fa4"] == 0.75 and row["thd-gluon/fa4"] == 1.5
    assert row["thd-tl/cudnn"] == 1.5 and row["thd-gluon/cudnn"] == 3.0
    assert row["thd-tl/fa4_meets_goal"] is False and row["thd-gluon/fa4_meets_goal"] is True
    assert "thd-tl/cudnn_meets_goal" not in row and not any("varlen_attn" in k for k in row)
    (old,) = report.speedups([_attention_record("thd", "fwd", 1.0), _attention_record("fa4", "fwd", 0.5)])
    assert old["thd/fa4"] == 0.5 and old["thd/fa4_meets_goal"] is False


def test_attention_readme_tables_name_both_families_and_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, report = _attention_modules(monkeypatch)
    records = [
        _attention_record(p, m, ms)
        for p, ms in (("thd-tl", 2.0), ("thd-gluon", 1.0), ("fa4", 1.0), ("cudnn", 4.0))
        for m in ("fwd", "fwd_bwd")
    ]
    text = report.markdown_tables({"env": {"device": "H200"}, "records": records})
    header = next(line for line in text.splitlines() if line.startswith("| tokens"))
    for col in ("thd tl fwd", "thd gluon fwd+bwd", "cuDNN fwd", "thd gluon/FA4 fwd", "thd tl/cuDNN fwd+bwd"):
        assert f"| {col} |" in header, (col, header)
    row = next(line for line in text.splitlines() if line.startswith("| 16k / 64"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[header.strip("|").split("|").index(" thd gluon/FA4 fwd ")] == "1.00"
    assert cells[header.strip("|").split("|").index(" thd tl/cuDNN fwd ")] == "2.00"


class _FakeChoice:
    def __init__(self, family: str) -> None:
        self.family = family


def test_attention_thd_families_run_under_thd_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``thd-tl`` / ``thd-gluon`` run with THD_KERNELS set around their calls only (restored after),
    record the family asked for and the one thd says ran; a family thd lacks is ``unavailable``."""
    import importlib
    import types

    providers, measure, _ = _attention_modules(monkeypatch)
    seen: list[str | None] = []
    ran: dict[str, str] = {}

    class Families:
        def family(self, name: str) -> object | None:
            return object() if name == "tl" else None

        def why_missing(self, name: str) -> str:
            return "ImportError: no gluon here"

    # thd.attention's modules bind the real dispatch before the stand-in below replaces it (run first
    # in a process, the test would otherwise import them against the stand-in)
    importlib.import_module("thd.ops.attention.interface")

    fake = types.ModuleType("thd.ops.attention.dispatch")
    fake.FAMILIES = Families()  # type: ignore[attr-defined]
    fake.kernel_choice = lambda phase="forward": _FakeChoice(ran[phase])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "thd.ops.attention.dispatch", fake)

    thd_call = providers._thd_call

    def traced(p):  # type: ignore[no-untyped-def]
        call = thd_call(p)

        def run(q, k, v):  # type: ignore[no-untyped-def]
            seen.append(os.environ.get("THD_KERNELS"))
            ran.update(forward=f"{os.environ.get('THD_KERNELS')}-ran", backward="bwd-ran")
            return call(q, k, v)

        return run

    monkeypatch.setattr(providers, "_thd_call", traced)
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    monkeypatch.delenv("THD_KERNELS", raising=False)
    p = providers.make_problem(providers.LayoutSpec(48, "64-1024"), 2, 16, 0, "cpu")
    settings = measure.Settings(rep_ms=1.0, trials=1)
    records = measure.measure_problem(p, ["thd-tl", "thd-gluon", "cudnn"], settings)
    by = {(r["provider"], r["mode"]): r for r in records}
    for mode in ("fwd", "fwd_bwd"):
        tl = by[("thd-tl", mode)]
        assert tl["status"] == "ok", tl.get("error")
        assert (
            tl["status"] == "ok" and tl["kernel_family_requested"] == "tl" and tl["kernel_family"] == "tl-ran"
        )
        assert tl.get("kernel_family_backward") == (None if mode == "fwd" else "bwd-ran")
        gluon = by[("thd-gluon", mode)]
        assert gluon["status"] == "unavailable" and "no gluon here" in gluon["error"]
        assert by[("cudnn", mode)]["status"] == "unavailable"
    assert set(seen) == {"tl"} and "THD_KERNELS" not in os.environ


def test_attention_figure_data_per_workload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import plot_attention

    d64 = {"tokens": 32768, "heads": 16, "head_dim": 64, "mix": "512-8192", "slot_multiple": 1}
    padded = {"tokens": 16384, "heads": 16, "head_dim": 128, "mix": "64-1024", "slot_multiple": 64}
    window = {**d64, "variant": "window4096"}
    records = [
        _attention_record("thd-tl", "fwd", 2.0, d64),
        _attention_record("fa4", "fwd", 1.0, d64),
        _attention_record("thd-gluon", "fwd", 4.0, padded),
        _attention_record("flex", "fwd", 1.0, padded),  # not in the figure
        _attention_record("thd-tl", "fwd", 1.0, window),  # variants are not workloads of the figure
    ]
    data = plot_attention.figure_data({"records": records, "commit": "abc"})
    assert data.workloads == [
        "D128 16k / 64\u20131024, slots rounded up to 64 rows",
        "D64 32k / 512\u20138192",
    ]
    assert data.providers == ["thd-tl", "thd-gluon", "fa4"]
    assert data.tflops[("fwd", "thd-tl")] == [None, 50.0] and data.tflops[("fwd", "thd-gluon")] == [
        25.0,
        None,
    ]
    assert data.tflops[("fwd_bwd", "fa4")] == [None, None] and "abc" in data.title
    pytest.importorskip("matplotlib")
    out = plot_attention.plot({"records": records}, tmp_path / "fig" / "attention.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and list(out.parent.iterdir()) == [out]
