"""The committed tile table is the one the committed sweep chose
(``benchmarks/results/attention-tiles.json``), ``THD_TILES`` files round-trip, and the integer
settings (``THD_DQ_MODE``, ``THD_FWD_MAX_REGISTERS``) are parsed or refused by name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from thd._runtime import config, tiles
from thd.errors import ThdValueError

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "benchmarks" / "results" / "attention-tiles.json"


def test_table_holds_the_sweeps_best_tiles() -> None:
    best = json.loads(SWEEP.read_text())["best_tiles"]
    assert best, "the sweep chose no tiles"
    for key, entry in best.items():
        kernel, dim_class, length = key.split(",")
        tile = tiles.TILES[(kernel, int(dim_class), length == "long")]
        assert tiles.tile_entry(tile) == entry, key


def test_default_dq_mode_is_the_sweeps() -> None:
    assert json.loads(SWEEP.read_text())["best_dq_mode"] == tiles.MEASURED_DQ_MODE


def test_tile_files_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = {
        ("fwd", 128, True): tiles.Tile(64, 64, 4, 3, tma=True),
        ("dq", 64, False): tiles.Tile(64, 32, 4, 2),
    }
    path = tmp_path / "tiles.json"
    path.write_text(
        json.dumps(
            {f"{k},{d},{'long' if lg else 'short'}": tiles.tile_entry(t) for (k, d, lg), t in wanted.items()}
        )
    )
    monkeypatch.setattr(tiles, "TILES", dict(tiles.TILES))
    tiles.load_tile_overrides(str(path))
    for key, tile in wanted.items():
        assert tiles.TILES[key] == tile


@pytest.mark.parametrize(("raw", "expected"), [("", 7), ("  ", 7), ("0", 0), (" 2 ", 2)])
def test_integer_settings_parse(raw: str, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THD_TEST_SETTING", raw)
    assert config.env_int("THD_TEST_SETTING", 7, range(3)) == expected


@pytest.mark.parametrize("raw", ["3", "-1", "abc", "1.5"])
def test_bad_integer_settings_name_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THD_TEST_SETTING", raw)
    with pytest.raises(
        ThdValueError, match=rf"THD_TEST_SETTING='{re.escape(raw)}': expected an integer from 0 to 2"
    ):
        config.env_int("THD_TEST_SETTING", 7, range(3))


def test_bad_register_cap_at_import_is_a_thd_error() -> None:
    """The launcher (imported by the first attention call) refuses a bad ``THD_FWD_MAX_REGISTERS``
    with the ThdValueError, not a bare ValueError from int()."""
    code = "import thd.ops.attention.launch"
    env = {**os.environ, "THD_FWD_MAX_REGISTERS": "many", "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert (
        "thd.errors.ThdValueError: THD_FWD_MAX_REGISTERS='many': expected an integer from 0 to 255"
        in run.stderr
    )


def test_register_cap_applies_to_small_forward_tiles_only(monkeypatch: pytest.MonkeyPatch) -> None:
    small, wide = {"BLOCK_D": 64, "BLOCK_DV": 64}, {"BLOCK_D": 128, "BLOCK_DV": 64}
    four, eight = tiles.Tile(64, 64, 4, 3), tiles.Tile(128, 64, 8, 3)
    monkeypatch.setattr(tiles, "SMALL_FWD_MAX_REGISTERS", 168)
    assert tiles.register_cap("fwd", four, small) == {"maxnreg": 168}
    assert tiles.register_cap("fwd", four, wide) == tiles.register_cap("fwd", eight, small) == {}
    assert tiles.register_cap("dkdv", four, small) == tiles.register_cap("dq", four, small) == {}
    monkeypatch.setattr(tiles, "SMALL_FWD_MAX_REGISTERS", 0)  # THD_FWD_MAX_REGISTERS=0: no cap
    assert tiles.register_cap("fwd", four, small) == {}
