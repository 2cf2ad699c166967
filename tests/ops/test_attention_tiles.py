"""The committed tile table is the one the committed sweep chose
(``benchmarks/results/attention-tiles.json``), and ``THD_TILES`` files round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thd.ops.attention import launch

SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "attention-tiles.json"


def test_table_holds_the_sweeps_best_tiles() -> None:
    best = json.loads(SWEEP.read_text())["best_tiles"]
    assert best, "the sweep chose no tiles"
    for key, entry in best.items():
        kernel, dim_class, length = key.split(",")
        tile = launch.TILES[(kernel, int(dim_class), length == "long")]
        assert launch._tile_entry(tile) == entry, key


def test_default_dq_mode_is_the_sweeps() -> None:
    assert json.loads(SWEEP.read_text())["best_dq_mode"] == launch.MEASURED_DQ_MODE


def test_tile_files_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiles = {
        ("fwd", 128, True): launch.Tile(64, 64, 4, 3, tma=True),
        ("dq", 64, False): launch.Tile(64, 32, 4, 2),
    }
    path = tmp_path / "tiles.json"
    path.write_text(
        json.dumps(
            {f"{k},{d},{'long' if lg else 'short'}": launch._tile_entry(t) for (k, d, lg), t in tiles.items()}
        )
    )
    monkeypatch.setattr(launch, "TILES", dict(launch.TILES))
    launch._load_tile_overrides(str(path))
    for key, tile in tiles.items():
        assert launch.TILES[key] == tile
